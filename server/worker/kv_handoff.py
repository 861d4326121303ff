"""The KV hand-off: a context leg's KV parked, served (``GET /kv/{id}``) and released
(``DELETE /kv/{id}``, ``/kv/by-request/{disagg_request_id}``); a generation leg's KV fetched from
the context worker its ``ctx_info_endpoint`` names, when :class:`KVSources` allows that host.

Parked KV is what a hostile or broken client can pin without a connection, so
it is bounded three ways: a context leg whose client is gone frees it at once
(nobody else knows its id); parked entries together hold at most
``max_parked_fraction`` of the cache, the oldest going first (:meth:`KVHandoff.parked`);
and a request that does not fit evicts parked entries, oldest first, before it
is refused with 503 (:mod:`server.worker.admission`). An evicted entry's
generation leg finds 404 and recomputes the prefill. KV fetches always need the
fastcore signature when a secret is set.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from fastcore import protocol as wire
from server import tracing
from server.auth import SIGNATURE_HEADER, sign_body
from server.errors import HTTPError
from server.http import Request, Responder
from server.tasks import stop_tasks

from .engine_api import Engine, EngineRequest, ParkedKVLost, prompt_checksum
from .internal_auth import InternalAuth
from .settings import WorkerSettings, host_port

if TYPE_CHECKING:
    from .kv_transfer import KVPayload
    from .metrics import WorkerMetrics
    from .request import ParsedRequest

log = logging.getLogger(__name__)

#: the only paths a generation worker fetches KV from (a ctx_request_id is 62 random bits)
KV_PATH_RE = re.compile(re.escape(wire.KV_PATH_PREFIX) + wire.KV_ID_PATTERN)
_KV_PREFIX = wire.KV_PATH_PREFIX.encode()
#: ``DELETE /kv/by-request/<disagg_request_id>``: an orchestrator whose context answer was lost
#: (cut mid-body, timed out) releases the KV it never learnt the id of (docs/protocol.md#faults)
_KV_BY_REQUEST = wire.KV_BY_REQUEST_PREFIX.encode()
#: parked entries remembered by their disagg_request_id (oldest forgotten first)
MAX_PARKED_BY_REQUEST = 16384


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KVSources:
    """Where a generation worker may fetch KV from: the host (and port) of ``ctx_info_endpoint``.

    With entries, only those (a host without a port allows any port; names
    are compared as written, never resolved). Without: any host when
    ``any_host`` (a shared secret is set, so only signed callers name an
    endpoint); else loopback only, and only for a caller that is itself on
    loopback: the worker never connects, for an unauthenticated caller, where
    that caller could not connect itself (a remote client naming
    ``127.0.0.1:<port>`` would otherwise probe the worker host's local ports;
    its fetch is not even tried). Whatever the host, only ``GET /kv/<digits>``
    over http(s) is ever fetched: a caller cannot point the fetch at another
    service's path.
    """

    def __init__(self, entries: Sequence[str], *, any_host: bool) -> None:
        self.entries = [host_port(e) for e in entries]
        self.any_host = any_host

    def allows(self, endpoint: str, *, caller_local: bool = True) -> bool:
        """Whether to fetch ``endpoint`` for a leg that came from a loopback peer (``caller_local``)
        or not."""
        try:
            parts = urlsplit(endpoint)
            port = parts.port
        except ValueError:
            return False
        host = parts.hostname
        if (
            parts.scheme not in ("http", "https")
            or not host
            or parts.username is not None
            or parts.query
            or parts.fragment
            or not KV_PATH_RE.fullmatch(parts.path)
        ):
            return False
        if not self.entries:
            return self.any_host or (caller_local and _is_loopback(host))
        port = port or (443 if parts.scheme == "https" else 80)
        return any(h == host and (p is None or p == port) for h, p in self.entries)


class KVFetchError(LookupError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def kv_signature(secret: bytes, path: str) -> str:
    """The signature of a KV fetch: it has no body, so it signs the path (nonce and time included)."""
    return sign_body(secret, path.encode())


class KVHandoff:
    """One worker's side of the KV hand-off: its parked entries (context legs) and its fetches
    (generation legs), the HTTP session and the expiry task they need."""

    def __init__(
        self,
        engine: Engine,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        auth: InternalAuth,
        traces: Any,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        #: who may fetch or release parked KV (the worker's signature verifier)
        self.auth = auth
        #: OpenTelemetry (server/tracing.py): None unless an OTLP endpoint is configured
        self.tracing = traces
        self.sources = KVSources(settings.kv_allow, any_host=settings.shared_secret is not None)
        self.max_parked_tokens = int(settings.max_parked_fraction * engine.kv_capacity_tokens)
        self.session: aiohttp.ClientSession | None = None
        self.expiry_task: asyncio.Task[None] | None = None
        #: disagg_request_id -> ctx_request_id of parked KV, for a release by the request's id
        self._parked_by_request: collections.OrderedDict[int, int] = collections.OrderedDict()
        #: fire-and-forget tasks (KV releases after a failed fetch), kept referenced until done
        self._background: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.session = aiohttp.ClientSession()
        self.expiry_task = asyncio.create_task(self._expire_parked_loop(), name="fastcore-kv-expiry")

    async def stop(self) -> None:
        try:
            if self._background:
                await asyncio.wait(list(self._background), timeout=1.0)
            await stop_tasks([self.expiry_task])
        finally:  # (a stop cancelled meanwhile closes its session all the same)
            if self.session is not None:
                await self.session.close()

    async def _expire_parked_loop(self) -> None:
        period = max(0.05, min(1.0, self.settings.kv_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            expired = self.engine.expire_parked()
            if expired:
                self.metrics.handoff.inc(expired, event="expired")

    async def handle(self, request: Request, out: Responder) -> None:
        """``/kv/...``: GET or DELETE only (a HEAD would hand the KV over to nobody)."""
        if request.method == b"GET":
            await self.serve(request, out)
        elif request.method == b"DELETE":
            self.release(request, out)
        else:
            raise HTTPError(405, "the KV endpoint takes GET or DELETE", headers={"Allow": "GET, DELETE"})

    # -- context side ----------------------------------------------------------------------------

    def parked(self, req: ParsedRequest, ctx_request_id: int) -> None:
        """A context leg's KV is parked under ``ctx_request_id``: remembered by its
        disagg_request_id, and the oldest parked entries evicted past ``max_parked_tokens``."""
        assert req.disagg is not None
        self.metrics.handoff.inc(event="parked")
        disagg_id = req.disagg.disagg_request_id
        if type(disagg_id) is int:
            by_request = self._parked_by_request
            by_request[disagg_id] = ctx_request_id
            if len(by_request) > MAX_PARKED_BY_REQUEST:
                by_request.popitem(last=False)
        over = self.engine.parked_tokens - self.max_parked_tokens
        if over > 0:
            self.metrics.handoff.inc(self.engine.evict_parked(over), event="evicted")

    def _kv_id(self, request: Request, signed: bytes, what: str, prefix: bytes = _KV_PREFIX) -> int:
        """The id at the end of a KV request's path (after ``prefix``) whose signature (over ``signed``)
        holds: a ctx_request_id, or after ``/kv/by-request/`` a disagg_request_id."""
        self.auth.check_kv_request(request, signed, what)
        raw_id = request.path[len(prefix) :]
        if not (raw_id.isdigit() and len(raw_id) <= 20):
            field = wire.CTX_REQUEST_ID if prefix == _KV_PREFIX else wire.DISAGG_REQUEST_ID
            raise HTTPError(400, f"{field} must be an integer", param=field)
        return int(raw_id)

    def release(self, request: Request, out: Responder) -> None:
        """``DELETE /kv/{id}``: the orchestrator gave up on the generation leg; free the parked KV now.

        Signed over ``DELETE <path>`` (a fetch's signature cannot release). ``/kv/by-request/<id>``
        names the entry by the leg's ``disagg_request_id`` instead.
        """
        if request.path.startswith(_KV_BY_REQUEST):
            disagg_id = self._kv_id(request, b"DELETE " + request.path, "release", _KV_BY_REQUEST)
            ctx_request_id = self._parked_by_request.pop(disagg_id, None)
            if ctx_request_id is None or not self.engine.discard_parked(ctx_request_id):
                raise HTTPError(404, f"no KV held for disagg_request_id {disagg_id}")
            self.metrics.handoff.inc(event="released")
            out.send(200, b'{"released": true}')
            return
        ctx_request_id = self._kv_id(request, b"DELETE " + request.path, "release")
        if not self.engine.discard_parked(ctx_request_id):
            raise HTTPError(
                404, f"no KV held for ctx_request_id {ctx_request_id} (already fetched or expired)"
            )
        self.metrics.handoff.inc(event="released")
        out.send(200, b'{"released": true}')

    async def serve(self, request: Request, out: Responder) -> None:
        """``GET /kv/{id}``: the parked KV, once (it is freed as it is read)."""
        from .kv_transfer import encode_kv  # torch: only engines that park KV get here

        ctx_request_id = self._kv_id(request, request.path, "fetch")
        parked = self.engine.take_parked(ctx_request_id)
        if parked is None:
            raise HTTPError(
                404, f"no KV held for ctx_request_id {ctx_request_id} (already fetched or expired)"
            )
        # The generation worker may hang up midway (timeout, cancel, crash) and
        # recompute the prefill; this handler is then cancelled. The KV is gone
        # either way (read_parked frees it): count it, without a traceback.
        served, failed = False, "abandoned"
        trace = tracing.start_kv_export(self.tracing, request, parked.num_tokens) if self.tracing else None
        try:
            # The gather (and a device-to-host copy on CUDA) must not run on the event loop.
            # Shielded: the read owns the blocks from here, and a cancelled executor
            # future whose job had not started yet (executor busy) would never free them.
            read = asyncio.get_running_loop().run_in_executor(None, self.engine.read_parked, parked)
            try:
                k, v = await asyncio.shield(read)
            except ParkedKVLost as exc:  # let go to the cache, and no longer all there (kv_cache)
                failed = "lost"
                log.info("the KV parked for ctx_request_id %d is lost: %s", ctx_request_id, exc)
                raise HTTPError(404, f"the KV of ctx_request_id {ctx_request_id} is lost: {exc}") from None
            pieces = encode_kv(
                k,
                v,
                prompt_crc32=parked.prompt_crc32,
                first_token=parked.first_token,
                first_logprob=parked.first_logprob,
            )
            out.send_pieces(200, pieces, b"application/octet-stream")
            if trace is not None:
                trace.set("fastcore.kv.bytes", sum(len(piece) for piece in pieces))
            await out.drain()
            served = not out.closed
        finally:
            self.metrics.handoff.inc(event="served" if served else failed)
            if trace is not None:
                trace.end(200 if served else 404 if failed == "lost" else 499)

    # -- KV hand-off, generation side ------------------------------------------

    async def fetch(
        self, endpoint: str, prompt_ids: np.ndarray, trace_headers: dict[str, str] | None = None
    ) -> KVPayload:
        """The prompt's KV from a context worker, or a :class:`KVFetchError` saying why not."""
        from .kv_transfer import (  # torch: real engines only
            KVTransferError,
            check_header,
            decode_kv,
            parse_prefix,
        )

        assert self.session is not None
        headers = trace_headers or {}
        if self.settings.shared_secret is not None:
            headers[SIGNATURE_HEADER] = kv_signature(self.settings.shared_secret, urlsplit(endpoint).path)
        layout = self.engine.kv_layout
        num_tokens = int(prompt_ids.size)
        crc = prompt_checksum(prompt_ids)
        timeout = aiohttp.ClientTimeout(total=self.settings.kv_fetch_timeout_s)
        try:
            async with self.session.get(
                endpoint, headers=headers, timeout=timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    raise KVFetchError(f"http_{resp.status}", f"context worker answered {resp.status}")
                body = bytearray(await resp.content.readexactly(12))
                header_len = parse_prefix(body)
                body += await resp.content.readexactly(header_len)
                try:
                    check_header(body[12:], layout, num_tokens=num_tokens, prompt_crc32=crc)
                except KVTransferError as exc:
                    raise KVFetchError("mismatch", str(exc)) from None
                # Sized by this worker's own model and prompt, never by the sender's header.
                body += await resp.content.readexactly(layout.payload_bytes(num_tokens))
        except KVTransferError as exc:
            raise KVFetchError("malformed", str(exc)) from None
        except asyncio.IncompleteReadError as exc:
            raise KVFetchError(
                "malformed", f"KV body ended early ({len(exc.partial)} bytes short read)"
            ) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise KVFetchError("unreachable", f"{type(exc).__name__}: {exc}") from None
        try:
            return decode_kv(body, layout, num_tokens=num_tokens, prompt_crc32=crc)
        except KVTransferError as exc:
            raise KVFetchError("malformed", str(exc)) from None

    def _release_soon(self, endpoint: str) -> None:
        """``DELETE`` a KV entry this worker gave up fetching, in the background (best effort)."""
        task = asyncio.get_running_loop().create_task(self._release(endpoint))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, endpoint: str) -> None:
        assert self.session is not None
        headers = {}
        if self.settings.shared_secret is not None:
            signed = b"DELETE " + urlsplit(endpoint).path.encode()
            headers[SIGNATURE_HEADER] = sign_body(self.settings.shared_secret, signed)
        try:
            timeout = aiohttp.ClientTimeout(total=min(2.0, self.settings.kv_fetch_timeout_s))
            async with self.session.delete(endpoint, headers=headers, timeout=timeout, allow_redirects=False):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.info("releasing the KV at %s failed: %s", endpoint, exc)

    async def attach(self, req: ParsedRequest, engine_req: EngineRequest, caller_local: bool = True) -> None:
        """A generation leg's KV fetched from its context worker into ``engine_req``; when it cannot
        be (not allowed, unreachable, refused, not the prompt's), counted and left to a recomputed
        prefill."""
        assert req.disagg is not None
        metrics = self.metrics
        endpoint = req.disagg.ctx_info_endpoint
        first = req.disagg.first_gen_tokens
        reason = None
        if not endpoint:
            reason = "no_endpoint"
        elif len(first) != 1:
            reason = "several_first_tokens"
        elif not self.sources.allows(endpoint, caller_local=caller_local):
            log.info(
                "ctx_info_endpoint %.200r is not an allowed KV source; recomputing the prefill", endpoint
            )
            reason = "not_allowed"
        if reason is not None:
            metrics.fetch_failures.inc(reason=reason)
            metrics.handoff.inc(event="recomputed")
            return
        assert endpoint is not None
        trace, span, trace_headers = tracing.current_trace(), None, None
        if trace is not None:  # the hand-off's span; the context worker's export span is its child
            span, trace_headers = tracing.start_kv_fetch(trace, endpoint, int(req.prompt_ids.size))
        try:
            payload = await self.fetch(endpoint, req.prompt_ids, trace_headers)
        except KVFetchError as exc:
            if trace is not None:
                tracing.end_span(trace, span, error=exc.reason)
            log.info("KV fetch from %s failed (%s): %s; recomputing the prefill", endpoint, exc.reason, exc)
            metrics.fetch_failures.inc(reason=exc.reason)
            metrics.handoff.inc(event="recomputed")
            if exc.reason == "unreachable" or exc.reason.startswith("http_5"):
                # The KV may still be parked there (the fetch never reached it, or timed out
                # before it was read): nobody else will fetch it, so say so now, not at its TTL.
                self._release_soon(endpoint)
            return
        if trace is not None:
            nbytes = self.engine.kv_layout.payload_bytes(int(req.prompt_ids.size))
            mismatch = "first token mismatch" if payload.first_token != first[0] else None
            tracing.end_span(trace, span, {"fastcore.kv.bytes": nbytes}, error=mismatch)
        if payload.first_token != first[0]:
            metrics.fetch_failures.inc(reason="mismatch")
            metrics.handoff.inc(event="recomputed")
            return
        engine_req.kv_import = (payload.k, payload.v)
        engine_req.kv_imported = True
        engine_req.forced_logprobs = [payload.first_logprob if req.params.logprobs is not None else None]
        metrics.handoff.inc(event="fetched")
