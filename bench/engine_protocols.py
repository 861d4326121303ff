"""What vLLM's and SGLang's prefill/decode protocols require of a router, as rules on request bodies.

One home for the rules that the benchmark mocks (``bench/pd_mocks.py``) and the
tests' strict stand-ins (``tests/vllm_standin.py``, ``tests/sglang_standin.py``)
check, so a router that passes one passes the other. Each ``check_*`` returns
the problems it found (empty: the leg is as the engine expects), each naming
the field. Facts come from the engines' own code (docs/protocol.md, "Other
engines' PD protocols (reference)"):

- vLLM NixlConnector: ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
  (the legs) and ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/*scheduler.py``
  (which fields the decode side needs: ``remote_block_ids`` and all of
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
  else "Got invalid KVTransferParams ... will not utilize KVTransfer").
- vLLM MooncakeConnector: ``examples/online_serving/disaggregated_serving/mooncake_connector/
  mooncake_connector_proxy.py`` and ``.../v1/mooncake/mooncake_connector.py`` (the
  prefill needs ``transfer_id``, the decode ``remote_engine_id``,
  ``remote_bootstrap_addr`` and ``transfer_id``).
- SGLang: ``python/sglang/srt/disaggregation/mini_lb.py`` (the same body to both
  legs with ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` drawn in
  [0, 2^63)).
"""

from __future__ import annotations

from typing import Any, TypeGuard

#: the kv_transfer_params the reference proxy (toy_proxy_server.py) puts on a NIXL prefill leg
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: what a NIXL decode worker needs beside ``remote_block_ids`` to pull (else it computes locally)
NIXL_DECODE_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
#: what a Mooncake decode worker needs to be pushed the KV (else it computes locally)
MOONCAKE_DECODE_REQUIRED = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
#: fields the reference proxy drops from a prefill leg ("not supported for P"): vLLM refuses
#: stream_options without stream=true, and a min_tokens above the prefill's max_tokens of 1
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
#: SGLang's rooms: mini_lb draws random.randint(0, 2**63 - 1)
ROOM_LIMIT = 1 << 63
SGLANG_BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def effective_max_tokens(req: dict[str, Any], chat: bool) -> Any:
    """The output cap vLLM applies: chat's ``max_completion_tokens`` wins over ``max_tokens``."""
    if chat and req.get("max_completion_tokens") is not None:
        return req["max_completion_tokens"]
    return req.get("max_tokens")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_vllm_prefill(req: dict[str, Any], chat: bool, connector: str = "nixl") -> list[str]:
    """A vLLM prefill leg: one token, not streamed, ``do_remote_decode`` (and Mooncake's ``transfer_id``)."""
    problems = []
    cap = effective_max_tokens(req, chat)
    if cap != 1:
        problems.append(f"prefill max_tokens={cap!r}, expected 1")
    if req.get("stream"):
        problems.append("prefill stream=true, expected false")
    if req.get("stream_options") is not None:
        problems.append("prefill stream_options present with stream=false (vLLM refuses it)")
    for name in PREFILL_DROPPED[1:]:
        value = req.get(name)
        if value is not None and not (_is_int(value) and value <= 1):
            problems.append(f"prefill {name}={value!r} above max_tokens 1 (vLLM refuses it)")
    ktp = req.get("kv_transfer_params")
    if not isinstance(ktp, dict) or ktp.get("do_remote_decode") is not True:
        return [*problems, f"prefill kv_transfer_params={ktp!r}, expected do_remote_decode=true"[:200]]
    if ktp.get("do_remote_prefill"):
        problems.append("prefill kv_transfer_params.do_remote_prefill is true")
    if connector == "mooncake" and not ktp.get("transfer_id"):
        problems.append("prefill kv_transfer_params.transfer_id missing (MooncakeConnector needs it)")
    return problems


def check_vllm_decode(req: dict[str, Any], connector: str = "nixl") -> list[str]:
    """A vLLM decode leg: ``do_remote_prefill`` with every field the connector needs to fetch the KV."""
    ktp = req.get("kv_transfer_params")
    if not isinstance(ktp, dict) or ktp.get("do_remote_prefill") is not True:
        return [f"decode kv_transfer_params={ktp!r}, expected do_remote_prefill=true"[:200]]
    problems = []
    if ktp.get("do_remote_decode"):
        problems.append("decode kv_transfer_params.do_remote_decode is true")
    if connector == "mooncake":
        missing = [name for name in MOONCAKE_DECODE_REQUIRED if ktp.get(name) is None]
    else:
        missing = [name for name in NIXL_DECODE_REQUIRED if name not in ktp]
        if not ktp.get("remote_block_ids"):
            missing.insert(0, "remote_block_ids")
    if missing:
        problems.append(
            f"decode kv_transfer_params lacks {', '.join(missing)} (the decode would compute locally)"
        )
    return problems


def check_sglang(req: dict[str, Any]) -> list[str]:
    """An SGLang leg (either): the bootstrap triple, the room in mini_lb's range."""
    problems = []
    host, port, room = (req.get(name) for name in SGLANG_BOOTSTRAP_FIELDS)
    if not isinstance(host, str) or not host:
        problems.append(f"bootstrap_host={host!r}")
    if not _is_int(port) or not 0 < port < 65536:
        problems.append(f"bootstrap_port={port!r}")
    if not _is_int(room) or not 0 <= room < ROOM_LIMIT:
        problems.append(f"bootstrap_room={room!r}, expected an int in [0, 2^63)")
    return problems


__all__ = [
    "MOONCAKE_DECODE_REQUIRED",
    "NIXL_DECODE_REQUIRED",
    "NIXL_PREFILL_PARAMS",
    "PREFILL_DROPPED",
    "ROOM_LIMIT",
    "SGLANG_BOOTSTRAP_FIELDS",
    "check_sglang",
    "check_vllm_decode",
    "check_vllm_prefill",
    "effective_max_tokens",
]
