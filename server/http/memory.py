"""Giving the C heap back to the OS: glibc's ``malloc_trim``, found once.

Python frees a large body's memory, but glibc keeps the freed heap (its mmap
threshold rises after large frees), so without a trim a process rests near
its peak RSS. :meth:`server.http.server.HTTPServer.trim_when_quiet` calls
this once a burst of large bodies is over.
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
