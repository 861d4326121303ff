"""Task plumbing shared by the orchestrator, the workers and the cluster code: one way to stop tasks.

A stop cancels its background tasks and waits for them to end. Not ``task.cancel(); with
suppress(CancelledError): await task``: while a coroutine awaits a task, a cancel of the coroutine
is handed to the task it awaits (asyncio's Task.cancel cancels what the task waits on), so the
stop's own cancel comes back as the task's CancelledError and is swallowed with it. A stop bounded
by its caller (``asyncio.wait_for``) then waits on, and a loop that restarts a task that way (stop
it, start a new one) goes on after its own cancel. :func:`stop_tasks` waits with ``asyncio.wait``,
whose waiter is its own future: a cancel of the waiting coroutine is raised there, whatever the
tasks do.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

__all__ = ["STOP_TASKS_S", "run_event_loop", "stop_tasks"]

_T = TypeVar("_T")

log = logging.getLogger("fastcore.tasks")

#: how long a stop waits for the tasks it cancelled to end (each ends within a loop pass or two)
STOP_TASKS_S = 5.0


async def stop_tasks(tasks: Iterable[asyncio.Task[Any] | None], *, within: float = STOP_TASKS_S) -> None:
    """Cancel ``tasks`` (None: no task) and wait for them to end: every stop's one wait.

    A cancel of the caller while it waits is raised (the tasks stay cancelled). Bounded: a task
    still running ``within`` seconds after its cancel (it swallowed it: a bug) is logged with where
    it runs and left, not waited for forever; one that had failed is logged."""
    waited = [t for t in tasks if t is not None]
    for task in waited:
        task.cancel()
    if not waited:
        return
    _, running = await asyncio.wait(waited, timeout=within)
    for task in waited:
        if task in running:
            where = io.StringIO()
            task.print_stack(file=where)
            log.error(
                "task %s ignored its cancel for %g s: left running. %s",
                task.get_name(),
                within,
                where.getvalue(),
            )
        elif not task.cancelled() and task.exception() is not None:
            log.error("task %s had failed", task.get_name(), exc_info=task.exception())


def run_event_loop(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to its end on uvloop when it is installed (the ``server`` extra has it), plain
    asyncio otherwise; its result. The orchestrator's and the worker's one loop: the same aiohttp
    code spends less CPU on uvloop (a torch worker streaming 32 x 64 tokens: 64.7 -> 55.5 us of
    worker CPU a token, measured with the worker's other costs as they were in issue 38)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
