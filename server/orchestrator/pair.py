"""Concurrent legs: a protocol whose prefill and decode legs run at once (``concurrent``: SGLang's bootstrap,
protocols/sglang.py), on the coroutine path.

A pair is a prefill worker and a decode worker, chosen by their pools' routers, and the legs' bodies
(the protocol's ``pair_legs``: SGLang's one body with the prefill's bootstrap address and a new room;
vLLM Mooncake's two on a new ``transfer_id``, protocols/vllm_mooncake.py). Each leg is one
attempt of :class:`.legs.LegRunner` (its breakers, health marks, signatures, metrics; no retry of its
own: a leg re-sent alone would join a room its partner left), each in a task:

- the decode leg relays its answer to the client (app.py's ``_relay``), the prefill leg's answer is
  read and discarded;
- a leg that fails cuts its partner at once (the task is cancelled: its connection closes, and SGLang
  aborts a request whose connection closed), else the survivor would wait for a bootstrap that never
  comes (SGLang's own timeout: 300 s);
- a pair whose leg failed before the client got a byte is retried (``max_retries``) with a new room,
  the failed leg's worker excluded; a prefill that fails after the decode's stream began ends it with
  the error in-band;
- the client leaving (the request's task cancelled) cuts both.

The callback path (exchange.py) runs one leg after the other; concurrent protocols take this path
from the start (``Orchestrator.callbacks``): making the callbacks concurrent is issue 37's item 1.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from server.errors import HTTPError, error_body
from server.http import BodyPiece, Responder, UpstreamResponse

from .legs import LegRunner, LegUnavailable, WorkerAnswer, leg_failed

if TYPE_CHECKING:
    from .metrics import Clock
    from .pools import Worker
    from .relay_common import ClientRequest
    from .routing import RequestKey

log = logging.getLogger("fastcore.orchestrator")

#: a leg's end that sends the pair to other workers (a timeout spent the request's time: not retried)
_RETRIED = ("failed", "refused", "no_worker", "circuit_open")


class _PairFailed(Exception):
    """One leg of a pair failed before the client got a byte: ``side`` ("context", "generation")."""

    def __init__(self, side: str, unavailable: LegUnavailable) -> None:
        super().__init__(side)
        self.side = side
        self.unavailable = unavailable


class PairRunner:
    """Runs a concurrent protocol's pairs for an orchestrator (app.py; see the module)."""

    def __init__(self, orch: Any) -> None:
        #: the Orchestrator (app.py imports this module: typed Any, no import circle)
        self.orch = orch
        config = orch.config
        self.attempts = config.max_retries + 1
        self.legs = LegRunner(max_retries=0, metrics=orch.metrics, upstream=orch._upstream, secret=orch.secret,
                              mark_failed=orch._mark_failed, release_lost_kv=orch._release_lost_kv_soon,
                              unavailable=orch._unavailable, max_worker_body=config.max_worker_body_bytes)  # fmt: skip

    async def run(
        self,
        out: Responder,
        req: ClientRequest,
        path: bytes,
        clock: Clock,
        key: RequestKey | None,
        tokens: int,
    ) -> int:
        """Serve one completion on pairs; the status the client got (a stream cut mid-way: 502)."""
        orch = self.orch
        relay = orch.relay
        no_prefill: list[Worker] = []  # failed, or without a bootstrap port
        no_decode: list[Worker] = []
        error: HTTPError | WorkerAnswer | None = None
        for attempt in range(self.attempts):
            prefill = self._prefill_worker(no_prefill, key)
            decode = orch.generation_pool.choose(exclude=no_decode, key=key)
            if prefill is None or decode is None:
                break
            if attempt:
                orch.metrics.retries_leg["context"].inc()
                orch.metrics.retries_leg["generation"].inc()
            legs = relay.pair_legs(req, prefill)
            clock.lap("build_context")
            try:
                status: int = await self._pair(out, req, path, legs, clock, key, tokens, prefill, decode)
                return status
            except _PairFailed as failed:
                error = failed.unavailable.error
                (no_prefill if failed.side == "context" else no_decode).append(
                    prefill if failed.side == "context" else decode
                )
                if failed.unavailable.reason not in _RETRIED:
                    break
                log.info("%s leg of a pair failed (%s): the pair is retried with a new room", failed.side,
                         failed.unavailable.reason)  # fmt: skip
        if error is not None:
            raise error
        missing = "prefill worker with a bootstrap port" if prefill is None else "decode worker"
        raise orch._unavailable(f"no healthy {missing}")

    def _prefill_worker(self, excluded: list[Worker], key: RequestKey | None) -> Worker | None:
        """The pool's choice among the prefill workers whose ``/server_info`` gave a bootstrap port (those
        without one are excluded for this request: their legs could not meet)."""
        pool = self.orch.context_pool
        while (
            worker := pool.choose(exclude=excluded, key=key)
        ) is not None and worker.bootstrap_port is None:
            log.warning("prefill worker %s has no %s: not chosen", worker.url,
                        self.orch.protocol.bootstrap_source)  # fmt: skip
            excluded.append(worker)
        return worker

    async def _pair(
        self, out: Responder, req: ClientRequest, path: bytes,
        legs: tuple[list[BodyPiece], list[BodyPiece]], clock: Clock, key: RequestKey | None, tokens: int,
        prefill: Worker, decode: Worker,
    ) -> int:  # fmt: skip
        """Both legs at once; the first to fail cuts the other (see the module)."""
        orch = self.orch
        protocol = orch.protocol
        loop = asyncio.get_running_loop()
        prefill_pieces, pieces = legs
        timeout, read_timeout, max_body, first_byte = orch.generation_bounds(req.stream, pieces)
        prefill_leg = loop.create_task(self.legs.run(
            "context", orch.context_pool, path, prefill_pieces, _discard, headers=orch.relay.leg_headers,
            extra=protocol.context_headers(req), timeout=orch._context_timeout(len(req.body)), key=key,
            tokens=tokens, first=prefill,
        ))  # fmt: skip
        decode_leg = loop.create_task(self.legs.run(
            "generation", orch.generation_pool, path, pieces, partial(orch._relay, out, req, clock),
            headers=orch.relay.leg_headers, extra=protocol.generation_headers(req, None), timeout=timeout, read_timeout=read_timeout, max_body=max_body,
            first_byte=first_byte, key=key, tokens=tokens, first=decode, ttfb=orch.metrics.generation_ttfb,
        ))  # fmt: skip
        try:
            await asyncio.wait((prefill_leg, decode_leg), return_when=asyncio.FIRST_COMPLETED)
            if prefill_leg.done() and (failure := _failure(prefill_leg)) is not None:
                return await self._prefill_failed(out, decode_leg, failure)
            try:
                status: int = await decode_leg
            except LegUnavailable as exc:
                raise _PairFailed("generation", exc) from None
            orch.metrics.path_disaggregated.inc()
            if status == 200 and not prefill_leg.done():
                # The client has its answer, so the KV was pushed: the prefill's own answer follows.
                await asyncio.wait((prefill_leg,))
            return status
        finally:
            await _cut(prefill_leg, decode_leg)

    async def _prefill_failed(
        self, out: Responder, decode_leg: asyncio.Task[int], failure: BaseException
    ) -> int:
        """The prefill leg failed: the decode leg is cut now; before the client got a byte, the pair
        failed (retried), after (a stream began), the stream ends with the error in-band."""
        if not decode_leg.done():
            decode_leg.cancel()
            await asyncio.wait((decode_leg,))
        elif not decode_leg.cancelled() and decode_leg.exception() is None:
            return decode_leg.result()  # the client's answer went out whole: the KV had been pushed
        if not out.started:
            if isinstance(failure, LegUnavailable):
                raise _PairFailed("context", failure)
            raise failure  # a worker's 4xx (the client's answer), or ours
        error = failure.error if isinstance(failure, LegUnavailable) else failure
        if not isinstance(error, HTTPError):
            error = leg_failed("context", "its worker refused it")
        out.flow = None
        out.write(b"data: " + error_body(502, error.message, code=error.code) + b"\n\n")
        out.end()
        out.flush()
        return 502


def _failure(task: asyncio.Task[Any]) -> BaseException | None:
    return None if task.cancelled() else task.exception()


async def _cut(*legs: asyncio.Task[Any]) -> None:
    """Cancel the legs still running (their connections close: the workers abort them) and wait for them;
    what they raised is retrieved (it was answered, or does not matter once the partner ended)."""
    running = [leg for leg in legs if not leg.done()]
    for leg in running:
        leg.cancel()
    if running:
        await asyncio.wait(running)
    for leg in legs:
        if not leg.cancelled():
            leg.exception()


async def _discard(worker: Worker, resp: UpstreamResponse) -> None:
    """A prefill worker's 200: its answer read to the end (its one token is not the client's) and dropped."""
    await resp.read()
