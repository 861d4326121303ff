"""fastcore.protocol: the protocol's names, defined once, importable without torch."""

from __future__ import annotations

import subprocess
import sys

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
