"""Giving the C heap back to the OS: glibc's ``malloc_trim``, found once; and keeping it meanwhile.

Python frees a large body's memory, but glibc keeps the freed heap (its mmap
threshold rises after large frees), so without a trim a process rests near
its peak RSS. :meth:`server.http.server.HTTPServer.trim_when_quiet` calls
this once a burst of large bodies is over.

Meanwhile a process that relays large bodies (the orchestrator: each 160 KB
request is a joined client body, a joined 214 KB context answer, their scans)
should not have glibc map and unmap them one by one: with its defaults each
such buffer was a fresh mmap or a heap top grown and trimmed back, paid in page
faults on every first touch and munmap on every free (at 40k-token prompts,
the orchestrator's system time per request halved without them).
:func:`keep_heap_for_bodies` takes buffers up to ``HEAP_BODIES_BELOW`` from
the heap and keeps its free top across frees; the trim when quiet gives it back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _find_malloc_trim() -> Callable[[], None] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return lambda: trim(0)


#: glibc's malloc_trim(0), or None where there is none
malloc_trim = _find_malloc_trim()

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: buffers below this many bytes come from the heap, not from an mmap of their own
HEAP_BODIES_BELOW = 64 << 20
#: the heap's free top is given back past this much (else by the trim when quiet)
HEAP_TRIM_THRESHOLD = 256 << 20


def keep_heap_for_bodies() -> bool:
    """glibc: buffers up to HEAP_BODIES_BELOW from the heap, its free top kept up to
    HEAP_TRIM_THRESHOLD (a process-wide setting: its servers' ``trim_when_quiet`` gives the heap
    back once large bodies stop coming). False where there is no mallopt (not glibc): nothing done."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BODIES_BELOW)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
    )
