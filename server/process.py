"""Process plumbing shared by the launcher and the cluster code: children that die with their parent.

``fastcore-serve up`` starts workers, an orchestrator and (``--cluster``) a
local etcd; tests and benchmarks start the same children. Each runs in its
own session (a terminal's Ctrl-C reaches only the parent, which stops them in
its order) and is sent SIGTERM if the parent dies, even by SIGKILL, so no
child outlives it holding a port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
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


def python_module(module: str) -> list[str]:
    """The argv that runs ``module`` as ``python -m`` does, in this interpreter, without the working
    directory first on the child's import path: ``-m`` puts it there, so a ``server/`` or
    ``fastcore/`` folder where the user stands (a clone's parent, a project of their own) would be
    imported in place of ours. ``-P`` (3.11+) leaves it out; before 3.11 the child drops it itself.
    Our packages are found as this process found them (:func:`import_path_env`)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    run = f"import runpy, sys; del sys.path[0]; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", run]


def import_path_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the folder this process imported ``server`` from first on PYTHONPATH, unless it
    is an installed one (site-packages, found anyway): a checkout run in place (found through the
    working directory, which :func:`python_module` leaves out) stays importable by its children."""
    root = str(Path(__file__).resolve().parent.parent)
    if root in _site_dirs():
        return env
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": root if not path else os.pathsep.join((root, path))}


def _site_dirs() -> set[str]:
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return {str(Path(d).resolve()) for d in dirs}


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
