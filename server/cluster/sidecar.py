"""``fastcore-serve register``: keep a worker that cannot register itself in a cluster (a sidecar).

vLLM's and SGLang's servers know nothing of fastcore's cluster. This process registers one of them
(``--url``, ``--role``, ``--protocol``) as :class:`~.registration.WorkerRegistration` registers a
fastcore worker: under a lease (etcd) or in an orchestrator's embedded registry (``http://``), renewed
every heartbeat, revoked when it stops (SIGTERM, SIGINT), so that the orchestrators watching the
cluster take the worker while this process runs beside it. The record names the worker's protocol,
and an orchestrator takes only the workers of its own ``worker_protocol`` (docs/protocol.md,
"Cluster discovery").

The model is read from the worker's ``GET /v1/models`` (vLLM, SGLang and trtllm-serve serve it: the
first model's ``id``) unless ``--model`` names it; nothing is registered until the worker answers, so
no orchestrator is sent to a worker still loading. Whether it stays healthy is then the orchestrators'
health checks' business, as for a worker that registers itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from urllib.parse import urlsplit

import aiohttp

from server.auth import SECRET_ENV, read_secret

from .records import (
    HEARTBEAT_INTERVAL_S,
    INACTIVE_TIMEOUT_S,
    PROTOCOLS,
    ROLES,
    ClusterSettings,
    RecordError,
    WorkerRecord,
    check_worker_url,
    new_worker_id,
)
from .registration import WorkerRegistration

log = logging.getLogger("fastcore.cluster")

#: the OpenAI models listing every engine serves
MODELS_PATH = "/v1/models"
#: seconds between reads of a worker's models while it does not answer
WAIT_INTERVAL_S = 1.0
_READ_TIMEOUT_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        metavar="URL",
        help="where the worker serves, http://HOST:PORT (as the orchestrators reach it)",
    )
    parser.add_argument(
        "--role",
        required=True,
        choices=ROLES,
        help="context (a prefill worker), generation (a decode worker) or both",
    )
    parser.add_argument(
        "--protocol",
        required=True,
        metavar="{" + ",".join(PROTOCOLS) + "}",
        help="what the worker's legs speak (an orchestrator takes the workers of its worker_protocol)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the model it serves (default: the first of its GET /v1/models, read before registering)",
    )
    parser.add_argument(
        "--worker-id", default=None, help="its id in the cluster (default: role-host-port-random)"
    )
    parser.add_argument(
        "--cluster-uri",
        required=True,
        metavar="URI",
        help="etcd://HOST:PORT[,HOST:PORT...] or an orchestrator's http://HOST:PORT registry",
    )
    parser.add_argument("--cluster-name", default="", help="the cluster's namespace (default empty)")
    parser.add_argument(
        "--heartbeat-interval-sec",
        type=float,
        default=HEARTBEAT_INTERVAL_S,
        help=f"seconds between lease renewals (default {HEARTBEAT_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--inactive-timeout-sec",
        type=float,
        default=INACTIVE_TIMEOUT_S,
        help="seconds without a renewal before the cluster forgets the worker "
        f"(default {INACTIVE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--shared-secret-file",
        default=None,
        metavar="PATH",
        help=f"the secret an http:// registry checks signatures with (default ${SECRET_ENV})",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.protocol not in PROTOCOLS:
            raise RecordError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {args.protocol!r}")
        url = check_worker_url(args.url.rstrip("/"))
        settings = ClusterSettings(
            cluster_uri=args.cluster_uri.rstrip("/"),
            cluster_name=args.cluster_name,
            heartbeat_interval_s=args.heartbeat_interval_sec,
            inactive_timeout_s=args.inactive_timeout_sec,
            secret=read_secret(None, args.shared_secret_file),
        )
        worker_id = args.worker_id or new_worker_id(args.role, urlsplit(url).port or 0)
        # every field but the model checked now, as every orchestrator would check the record
        WorkerRecord.from_json(
            WorkerRecord(worker_id, args.role, args.model or "-", url, protocol=args.protocol).to_json()
        )
    except (OSError, ValueError) as exc:  # RecordError is a ValueError
        print(f"fastcore-serve register: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_keep(settings, worker_id, args.role, url, args.protocol, args.model))


async def worker_model(
    url: str,
    *,
    attempts: int = 0,
    interval_s: float = WAIT_INTERVAL_S,
    session: aiohttp.ClientSession | None = None,
) -> str | None:
    """The first model ``url``'s ``GET /v1/models`` lists; read every ``interval_s`` until it answers
    (``attempts``: at most that many reads, then None; 0: until it answers)."""
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        tried = 0
        while True:
            tried += 1
            why = ""
            try:
                timeout = aiohttp.ClientTimeout(total=_READ_TIMEOUT_S)
                async with session.get(url + MODELS_PATH, timeout=timeout) as resp:
                    listing = await resp.json(content_type=None) if resp.status == 200 else None
                    why = f"HTTP {resp.status}"
                models = listing.get("data") if isinstance(listing, dict) else None
                first = models[0] if isinstance(models, list) and models else None
                model = first.get("id") if isinstance(first, dict) else None
                if not isinstance(model, str) or not model:
                    why = why if listing is None else "no model listed"
                else:
                    return model
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                why = repr(exc)
            if tried == 1:
                log.info("register: waiting for %s%s (%s)", url, MODELS_PATH, why)
            if attempts and tried >= attempts:
                return None
            await asyncio.sleep(interval_s)
    finally:
        if own:
            await session.close()


async def _keep(
    settings: ClusterSettings, worker_id: str, role: str, url: str, protocol: str, model: str | None
) -> int:
    """Register once the model is known, keep the registration until SIGTERM or SIGINT, then revoke it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with aiohttp.ClientSession() as session:
        if model is None:
            reading = loop.create_task(worker_model(url, session=session))
            stopping = loop.create_task(stop.wait())
            await asyncio.wait((reading, stopping), return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
                return 0
            model = reading.result()
            assert model is not None
        record = WorkerRecord(worker_id, role, model, url, protocol=protocol)
        try:
            WorkerRecord.from_json(record.to_json())  # the model read from the worker, checked too
        except RecordError as exc:
            print(f"fastcore-serve register: the worker's model: {exc}", file=sys.stderr)
            return 2
        registration = WorkerRegistration(settings, record, session=session)
        try:
            await registration.start()
            print(
                f"fastcore-serve register: {role} worker {url} ({protocol}, model {model}) kept in "
                f"{settings.cluster_uri} as {worker_id}",
                file=sys.stderr,
                flush=True,
            )
            await stop.wait()
        finally:
            await registration.stop()
    return 0


__all__ = ["add_arguments", "run", "worker_model"]
