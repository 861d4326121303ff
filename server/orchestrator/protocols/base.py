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
