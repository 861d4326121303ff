"""The shipped code's size (issue 41): no function over 80 lines in fastcore/ or server/, no source file
over 800 lines in server/ (Python, Cython and its declarations; vendored C is not ours to cut).

A longer function is read in pieces anyway; its steps named are easier to follow and to test. The
one exception is the JSON scanner's state machine (fastcore/_scan_py.py's ``_scan``, the pure twin
of _scan.pyx's): one loop over a byte's states, which reads best whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 800
SOURCE_SUFFIXES = (".py", ".pyx", ".pxd", ".pyi")
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


def long_files(root: Path, package: str) -> list[str]:
    """``path (N lines)`` of each source file in ``package`` over the bound."""
    found = []
    for path in sorted((root / package).rglob("*")):
        if path.suffix in SOURCE_SUFFIXES and path.is_file():
            lines = len(path.read_text().splitlines())
            if lines > MAX_FILE_LINES:
                found.append(f"{path.relative_to(root).as_posix()} ({lines} lines)")
    return found


def test_no_server_file_over_800_lines() -> None:
    assert long_files(ROOT, "server") == []


def test_a_long_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "m.pyx").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (tmp_path / "pkg" / "ok.py").write_text("x = 1\n" * MAX_FILE_LINES)
    (tmp_path / "pkg" / "data.txt").write_text("x\n" * (MAX_FILE_LINES + 1))
    assert long_files(tmp_path, "pkg") == [f"pkg/sub/m.pyx ({MAX_FILE_LINES + 1} lines)"]


def test_no_function_over_80_lines() -> None:
    assert long_functions(ROOT, ("fastcore", "server")) == []


def test_a_long_function_is_named(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}")
    assert long_functions(tmp_path, ("pkg",)) == [f"pkg/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
