"""``worker_protocol: auto``: which engine each worker is, read from what it serves (docs/protocol.md,
"Worker protocols", auto).

Each worker is asked, in this order, until one answer names its engine:

- ``GET /server_info``: SGLang's (``disaggregation_mode`` / ``disaggregation_bootstrap_port``, its server
  arguments) is ``sglang``; trtllm-serve's (``disaggregated_params``) and a fastcore worker's (``role``
  and ``instance``) are ``trtllm``;
- ``GET /v1/models``: a card ``owned_by: vllm`` is ``vllm`` (vLLM serves no ``/server_info``; its
  ``/version`` names no engine, only a version);
- ``GET /get_server_info``: an older SGLang's name for the same answer.

At startup (:func:`resolve_auto`, before the orchestrator is built) every listed worker is asked: one
protocol for all is the config's; workers of two protocols, or a worker that answers as none, refuse
the start naming them; workers that do not answer yet are skipped (a round is repeated until one does).
Later, a worker that turns healthy as another engine is kept out of routing (:func:`guard_probe`: its
capabilities say why, pools.HealthChecker logs it and leaves it unhealthy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import aiohttp

import fastcore.protocol as wire
from server.cluster import ClusterWatcher, WorkerRecord

from ..discovery import ROLE_POOLS, cluster_settings, hosts_registry
from ..pools import Capabilities, Worker, read_json

log = logging.getLogger("fastcore.orchestrator")

#: the protocol name of a worker that answered, but as no engine this orchestrator speaks to
UNKNOWN = "unknown"
_SGLANG_MEMBERS = ("disaggregation_mode", "disaggregation_bootstrap_port")

Probe = Callable[[aiohttp.ClientSession, Worker, aiohttp.ClientTimeout], Awaitable[Capabilities]]


def protocol_of_server_info(info: Any) -> str | None:
    """The protocol a ``/server_info`` (or ``/get_server_info``) answer names; None: it names none."""
    if not isinstance(info, dict):
        return None
    if any(name in info for name in _SGLANG_MEMBERS):
        return "sglang"
    if wire.INFO_TRTLLM_MARKER in info or (wire.INFO_ROLE in info and wire.INFO_INSTANCE in info):
        return "trtllm"
    return None


def protocol_of_models(models: Any) -> str | None:
    """``vllm`` where a ``/v1/models`` card is ``owned_by: vllm``; None otherwise."""
    cards = models.get("data") if isinstance(models, dict) else None
    if isinstance(cards, list) and any(isinstance(c, dict) and c.get("owned_by") == "vllm" for c in cards):
        return "vllm"
    return None


async def detect(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> str | None:
    """The protocol ``url``'s worker speaks; :data:`UNKNOWN` when it answered as none; None when it
    answered nothing (down, or not up yet)."""
    answered, info = await _get(session, url + wire.SERVER_INFO_PATH, timeout)
    if (name := protocol_of_server_info(info)) is not None:
        return name
    if not answered:
        return None
    if (name := protocol_of_models((await _get(session, url + "/v1/models", timeout))[1])) is not None:
        return name
    if (
        name := protocol_of_server_info((await _get(session, url + "/get_server_info", timeout))[1])
    ) is not None:
        return name
    return UNKNOWN


async def _get(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> tuple[bool, Any]:
    """Whether ``GET url`` got an HTTP answer at all, and its JSON (None: not a 200, not JSON)."""
    try:
        async with session.get(url, timeout=timeout) as resp:
            if resp.status != 200:
                return True, None
            try:
                return True, await resp.json(content_type=None)
            except ValueError:
                return True, None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return False, None


def choose(found: dict[str, str]) -> str:
    """The one protocol of ``found`` (worker URL -> its protocol); ValueError naming the workers of a
    mixed or unknown pool."""
    unknown = sorted(url for url, name in found.items() if name == UNKNOWN)
    if unknown:
        raise ValueError(
            f"worker {', '.join(unknown)} answers as no engine this orchestrator speaks to (no trtllm-serve, "
            "fastcore or SGLang /server_info, no vLLM /v1/models card): set worker_protocol"
        )
    names = sorted(set(found.values()))
    if len(names) > 1:
        by_name = "; ".join(
            f"{name}: {', '.join(sorted(u for u, n in found.items() if n == name))}" for name in names
        )
        raise ValueError(f"the workers speak more than one protocol ({by_name}): one protocol per deployment")
    return names[0]


async def detect_pool(
    urls: list[str],
    *,
    timeout_s: float,
    interval_s: float,
    registered: Callable[[], dict[str, str]] | None = None,
) -> str:
    """The protocol every worker of ``urls`` that answers speaks, and every registered worker's record
    names (``registered``: URL -> its record's protocol, read each round); rounds until one answers or
    is registered (see :func:`choose`)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession() as session:
        while True:
            names = await asyncio.gather(*(detect(session, url, timeout) for url in urls))
            found = {url: name for url, name in zip(urls, names, strict=True) if name is not None}
            if registered is not None:
                found.update(registered())
            if found:
                silent = [url for url, name in zip(urls, names, strict=True) if name is None]
                if silent:
                    log.warning(
                        "worker_protocol: auto: %s did not answer; decided from the others", ", ".join(silent)
                    )
                return choose(found)
            log.info(
                "worker_protocol: auto: no worker answered%s yet; asking again in %.1f s",
                "" if registered is None else " or registered",
                interval_s,
            )
            await asyncio.sleep(interval_s)


def probe_of(protocol: Any) -> Probe:
    """``protocol``'s capability probe: its own (``probe``), else its ``capabilities_path`` read by its
    ``capabilities``."""
    own: Probe | None = getattr(protocol, "probe", None)
    if own is not None:
        return own

    async def probe(
        session: aiohttp.ClientSession, worker: Worker, timeout: aiohttp.ClientTimeout
    ) -> Capabilities:
        caps: Capabilities = protocol.capabilities(
            await read_json(session, worker.url + protocol.capabilities_path, timeout)
        )
        return caps

    return probe


async def resolve_auto(config: Any) -> Any:
    """``config`` (``worker_protocol: auto``) with the protocol its listed workers speak, its features
    checked against it; :class:`..config.ConfigError` naming the workers of a mixed or unknown pool.

    With ``disagg_cluster`` the workers registered there count as listed ones, by the protocol their
    records name (a record that names none speaks trtllm's; server/cluster/records.py): the cluster
    is read until the first worker is registered (or a listed one answers). Discovery then takes
    only the records of that protocol, refusing another with one line naming both, and the health
    check keeps out a worker whose /server_info says another engine (:func:`guard_probe`)."""
    from ..config import ConfigError  # config.py imports this package: no import circle at load

    urls = [*config.context_servers.urls, *config.generation_servers.urls]
    cluster = config.disagg_cluster
    if cluster is not None and hosts_registry(cluster.cluster_uri, config.hostname, config.port):
        raise ConfigError(
            "worker_protocol: auto: disagg_cluster: auto reads the registered workers' records before the "
            f"orchestrator starts, and the registry at {cluster.cluster_uri} is this orchestrator's own (its "
            "workers register once it serves): name the protocol (trtllm, vllm or sglang), or keep the "
            "registry in etcd"
        )
    watcher = None
    if cluster is not None:
        watcher = ClusterWatcher(cluster_settings(cluster, config.shared_secret_bytes), _ignore)
        await watcher.start()
    try:
        name = await detect_pool(
            urls,
            timeout_s=config.health_check_timeout_s,
            interval_s=config.health_check_interval_s,
            registered=None if watcher is None else partial(_registered, watcher, config.model),
        )
    except ValueError as exc:
        raise ConfigError(f"worker_protocol: auto: {exc}") from None
    finally:
        if watcher is not None:
            await watcher.stop()
    log.info("worker_protocol: auto: the workers speak %s", name)
    resolved = config.model_copy(update={"worker_protocol": name})
    resolved.check_runnable()
    return resolved


def _ignore(records: dict[str, WorkerRecord]) -> None:
    """resolve_auto's watcher is read each round (``workers``), not followed."""


def _registered(watcher: ClusterWatcher, model: str | None) -> dict[str, str]:
    """URL -> protocol of the registered workers discovery could take (a known role; the
    deployment's ``model`` where both name one)."""
    return {
        record.url: record.protocol
        for record in watcher.workers.values()
        if record.role in ROLE_POOLS and not (model and record.model and record.model != model)
    }


def guard_probe(name: str, probe: Probe) -> Probe:
    """``probe`` for a pool whose protocol ``auto`` chose: a worker that turns healthy as another engine
    (or none) gets capabilities that refuse it (pools.HealthChecker keeps it out of routing)."""

    async def guarded(
        session: aiohttp.ClientSession, worker: Worker, timeout: aiohttp.ClientTimeout
    ) -> Capabilities:
        found = await detect(session, worker.url, timeout)
        if found is not None and found != name:
            what = "no engine this orchestrator speaks to" if found == UNKNOWN else found
            return Capabilities(
                refused=f"it answers as {what}; worker_protocol: auto chose {name} at startup"
            )
        return await probe(session, worker, timeout)

    return guarded
