"""The processes behind ``fastcore-serve``: orchestrator, workers, launcher, cluster plumbing.

Every one of them is built on this distribution's ``fastcore`` package. fast.ai's
PyPI project of the same name installs a top-level ``fastcore`` too: installed
over ours (or found first on the import path) every module here would fail with
an AttributeError of its own, so its import is checked here, once, and named.
"""

from __future__ import annotations

import sys

import fastcore as _fastcore

if not hasattr(_fastcore, "backend"):  # ours always has it (fastcore/__init__.py)
    print(
        f"fastcore-serve: `import fastcore` finds another project's package "
        f"(version {getattr(_fastcore, '__version__', 'unknown')}, {getattr(_fastcore, '__file__', '?')}), "
        "most likely fast.ai's, not this one's; install fastcore-serve into a virtual environment "
        "of its own (python -m venv .venv && .venv/bin/pip install -e '.[worker]' from the clone)",
        file=sys.stderr,
    )
    raise SystemExit(2)
