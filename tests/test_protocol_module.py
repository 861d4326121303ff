"""fastcore.protocol: the protocol's names, defined once, importable without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from fastcore import protocol


def test_imports_without_torch() -> None:
    code = "import sys, fastcore.protocol; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_internal_fields_per_route() -> None:
    assert protocol.internal_request_fields(chat=True) == (
        "disaggregated_params",
        "prompt_token_ids_b64",
        "prompt_token_ids",
    )
    assert protocol.internal_request_fields(chat=False) == ("disaggregated_params", "prompt_token_ids_b64")
    assert set(protocol.INTERNAL_FIELDS) == set(protocol.INTERNAL_CHAT_REQUEST_FIELDS)


def test_disagg_request_id_range() -> None:
    assert protocol.is_disagg_request_id(2**40)
    assert protocol.is_disagg_request_id(2**63 - 1)
    assert not protocol.is_disagg_request_id(2**40 - 1)
    assert not protocol.is_disagg_request_id(2**63)
    assert not protocol.is_disagg_request_id(True)
    assert not protocol.is_disagg_request_id(float(2**41))


def test_generation_follows() -> None:
    assert protocol.GENERATION_FOLLOWS == ("length", "not_finished")
    assert set(protocol.GENERATION_FOLLOWS) <= set(protocol.COMMON_FINISH_REASONS)


#: Names only this protocol defines (not the OpenAI fields every server spells).
_PROTOCOL_NAMES = {
    *protocol.INTERNAL_FIELDS,
    *protocol.REQUEST_TYPES,
    protocol.REQUEST_TYPE,
    protocol.DISAGG_REQUEST_ID,
    protocol.RETURN_PROMPT_TOKEN_IDS_B64,
    protocol.FIRST_GEN_TOKENS,
    protocol.CTX_REQUEST_ID,
    protocol.ENCODED_OPAQUE_STATE,
    protocol.CTX_INFO_ENDPOINT,
    protocol.DRAFT_TOKENS,
    protocol.CTX_USAGE,
    protocol.FINISH_NOT_FINISHED,
    protocol.CHAT_COMPLETIONS_PATH,
    protocol.COMPLETIONS_PATH,
    protocol.X_TRTLLM_DISAGG_AUTH,
    protocol.X_TRTLLM_MSGPACK,
    protocol.X_TRTLLM_MSGPACK.lower(),
    protocol.SERVER_INFO_PATH,
    protocol.KV_PATH_PREFIX,
    protocol.KV_PATH,
    protocol.KV_BY_REQUEST_PREFIX,
    protocol.CONVERSATION_PARAMS,
    protocol.CONVERSATION_ID,
    # /server_info keys (those that are not also attribute, config or engine names: local_prefill,
    # kv_capacity_tokens, bytes_per_token, prefix_caching, trtllm_disagg_auth and
    # accept_trtllm_orchestrator, the worker's setting of that name, are those too)
    protocol.INFO_KV_ENDPOINT,
    protocol.INFO_MAX_PARKED_TOKENS,
    protocol.INFO_B64_CHAT,
    protocol.INFO_B64_COMPLETIONS,
    protocol.INFO_MSGPACK_REQUESTS,
    protocol.INFO_INTERNAL_AUTH,
    protocol.INFO_AUTH_FASTCORE_SIGNATURE,
    protocol.INFO_KV_TIER2_CAPACITY_TOKENS,
    protocol.INFO_KV_TIER2_LOAD_TOKENS_PER_S,
    protocol.INFO_PREFILL_TOKENS_PER_S,
}


def test_the_protocol_names_are_spelled_only_in_fastcore_protocol() -> None:
    """No module of the package or the servers spells a protocol name as a literal of its own:
    each imports it from fastcore.protocol (error messages may mention names inside longer text)."""
    root = Path(__file__).resolve().parent.parent
    sources = [p for p in (root / "fastcore").glob("*.py") if p.name != "protocol.py"]
    sources += sorted((root / "server").rglob("*.py"))
    assert len(sources) > 20
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
                if text in _PROTOCOL_NAMES:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {text!r}")
    # The compiled twins too: their C writes the text the pure twins build from fastcore.protocol.
    for path in sorted((root / "fastcore").glob("*.pyx")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in _PROTOCOL_NAMES:
                if f'"{name}"' in line or f"'{name}'" in line or f'\\"{name}\\"' in line:
                    found.append(f"{path.relative_to(root)}:{number}: {name!r}")
    assert found == [], "\n".join(found)
