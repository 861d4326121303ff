"""What every worker protocol reads of the orchestrator's config, as a structural type.

The protocols are built from the config (``OrchestratorConfig``), and config.py asks them what
they refuse (``refusal``), so they name the fields they read here instead of importing config.py.
"""

from __future__ import annotations

from typing import Any, Protocol


class ProtocolConfig(Protocol):
    """The ``OrchestratorConfig`` fields a protocol reads (config.py documents each). The names the
    config types as literals are read-only properties here: a ``Literal`` field is a ``str`` to read."""

    @property
    def worker_protocol(self) -> str: ...
    @property
    def relay(self) -> str: ...
    @property
    def context_fallback(self) -> str: ...

    @property
    def vllm_transfer(self) -> str: ...

    vllm_mooncake_bootstrap_port: int
    gen_tokids_ctxbytes: bool
    gen_strip_message_history: bool
    conditional_disagg_config: Any
    disagg_cluster: Any

    @property
    def trtllm_auth_key(self) -> bytes | None: ...


def plain_request_refusal(config: ProtocolConfig, why: str) -> str | None:
    """What a protocol with no decode worker that serves a client's plain request (``serves_plain_request``
    False: ``why``) refuses alike: conditional disaggregation (its decode-only path is that request) and
    ``context_fallback: local_prefill`` set explicitly (the default says nothing there: a failed pair is
    retried on another prefill worker, else the client's 503 names the missing one)."""
    chosen = getattr(config, "model_fields_set", ())
    if config.context_fallback == "local_prefill" and "context_fallback" in chosen:
        return (
            f"context_fallback: local_prefill: {why}, so there is no local prefill; use context_fallback: "
            "fail and more prefill workers (a failed pair is retried on another)"
        )
    if config.conditional_disagg_config is not None:
        return f"conditional_disagg_config: {why}, so no request is served decode-only; remove it"
    return None


def scanner_refusal(config: ProtocolConfig, name: str, legs: str) -> str | None:
    """What every protocol whose legs the fast relay's scanner builds from the client's body (vLLM's,
    SGLang's) refuses alike, naming ``name`` (its ``worker_protocol``) and ``legs`` (what its legs are,
    so why trtllm-serve's relay gates cannot apply): another relay mode, a relay gate on."""
    if config.relay != "fast":
        return (
            f"relay: {config.relay} builds trtllm-serve's legs; worker_protocol: {name} builds its legs "
            "with the fast relay's scanner only: use relay: fast"
        )
    for gate in ("gen_tokids_ctxbytes", "gen_strip_message_history"):
        if getattr(config, gate):
            return f"{gate}: a trtllm-serve relay gate; {legs}: turn it off"
    return None
