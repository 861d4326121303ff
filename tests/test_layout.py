"""The tests' own layout (issue 24, item 10).

- What test modules share lives in helper modules (helpers.py, engines.py, raw_http.py, ...), never in
  a test module that another imports: pytest collects a test module, and its fixtures and module
  state, once for itself and again for each importer.
- Each helper module is imported under one name, the one pytest gives it (tests/ on ``sys.path``):
  ``from tiny_workers import ...``, not ``from tests.tiny_workers import ...``, which makes a second
  module with its own fixtures and state; conftest.py is never imported at all.
- A module that needs torch skips at collection where torch is missing (``pytest.importorskip``)
  instead of erroring: the synthetic-worker and orchestrator tests run without the [worker] extra.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

#: Put first on PYTHONPATH, it makes every import of torch fail as on a machine without it.
WITHOUT_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, in functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def offenders(rule) -> list[str]:
    return [
        f"tests/{path.name}:{line}: {module}"
        for path in sorted(TESTS.glob("*.py"))
        for line, module in imports(path)
        if rule(module)
    ]


def test_no_test_module_imports_another() -> None:
    assert offenders(lambda module: module.split(".")[0].startswith("test_")) == []


def test_helper_modules_and_conftest_are_imported_under_one_name() -> None:
    assert offenders(lambda module: module.split(".")[0] in ("tests", "conftest")) == []


@pytest.mark.slow
def test_modules_that_need_torch_skip_at_collection_without_it(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_TORCH)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", str(TESTS)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " error" not in output.splitlines()[-1], output[-4000:]
    assert "could not import 'torch'" in output  # torch was missing there, and some module skipped


def test_the_http_layer_imports_no_aiohttp() -> None:
    """server.http (its responder: server.errors) and the error bodies load without aiohttp: the
    orchestrator's HTTP layer is its own, and aiohttp's web was only a dead error_response's."""
    code = "import sys, server.http, server.errors; print(sorted(m for m in sys.modules if m.startswith('aiohttp')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
