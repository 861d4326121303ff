"""The shipped code's function size (issue 41): no function over 80 lines in fastcore/ or server/.

A longer function is read in pieces anyway; its steps named are easier to follow and to test. The
one exception is the JSON scanner's state machine (fastcore/_scan_py.py's ``_scan``, the pure twin
of _scan.pyx's): one loop over a byte's states, which reads best whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
#: (path, function) allowed past the bound, each with its reason in the module's docstring
EXCEPTIONS = {("fastcore/_scan_py.py", "_scan")}


def long_functions(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``path:line name (N lines)`` of each function in ``packages`` over the bound, decorators left out."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), name)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and (name, node.name) not in EXCEPTIONS:
                    found.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines() -> None:
    assert long_functions(ROOT, ("fastcore", "server")) == []


def test_a_long_function_is_named(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}")
    assert long_functions(tmp_path, ("pkg",)) == [f"pkg/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
