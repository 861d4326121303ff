"""Process plumbing shared by the launcher and the cluster code: children that die with their parent.

``fastcore-serve up`` starts workers, an orchestrator and (``--cluster``) a
local etcd; tests and benchmarks start the same children. Each runs in its
own session (a terminal's Ctrl-C reaches only the parent, which stops them in
its order) and is sent SIGTERM if the parent dies, even by SIGKILL, so no
child outlives it holding a port.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

#: Linux's prctl option: the signal a child gets when its parent dies (prctl(2))
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the parent dies (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_child(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    stdin: IO[Any] | int | None = None,
) -> subprocess.Popen[bytes]:
    """``argv`` in its own session, SIGTERMed if this process dies (:func:`die_with_parent`)."""
    return subprocess.Popen(
        list(argv), env=env, stdout=stdout, stderr=stderr, stdin=stdin,
        start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
