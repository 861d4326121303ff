"""No import circles in fastcore/, server/ and bench/ (issue 24: one home for each concept).

The graph is read from the source with ast, nothing is imported; a compiled module's
``.pyx`` and its ``.pxd`` are read too (their ``import`` and ``cimport`` statements, each parsed as
Python's), so a circle through a compiled module is one; a pure ``x.py`` beside a compiled ``_x.pyx``
imports it (the twin rule: ``fastcore.compiled_twin`` picks it by name). Every import counts: at module level, inside a function (a deferred import hides a circle,
it does not remove it) and under ``if TYPE_CHECKING:`` (a type one module
borrows from another that imports it is still two modules that each need the
other). An edge goes to the deepest module of the repository the import names
(``from pkg import mod`` is ``pkg.mod``, ``from pkg import name`` is ``pkg``);
a module's own package is not an edge (Python runs it first).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fastcore", "server", "bench")

#: circles left in files being edited by others, each with the issue that removes it. The test
#: fails on any other circle, and on one of these once it is gone (then remove it here).
KNOWN_CIRCLES: set[frozenset[str]] = set()


#: Cython's sources: a compiled module is its ``.pyx``, with the declarations of its ``.pxd``
CYTHON_SUFFIXES = (".pyx", ".pxd")

#: an import statement of a Cython source, on its own line (parenthesized names may span lines)
CYTHON_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+[.\w]+[ \t]+c?import[ \t]+(?:\([^)]*\)|[^\n]+)|c?import[ \t]+[^\n]+)", re.M
)


def modules(root: Path, packages: Iterable[str]) -> dict[str, list[Path]]:
    """Dotted name -> its files (a ``.py``, or a compiled module's ``.pyx`` and ``.pxd``), for every
    module of ``packages`` under ``root``."""
    found: dict[str, list[Path]] = {}
    for package in packages:
        paths = [p for p in (root / package).rglob("*") if p.suffix in (".py", *CYTHON_SUFFIXES)]
        for path in sorted(paths):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), []).append(path)
    return found


def import_nodes(path: Path) -> Iterator[ast.AST]:
    """The import statements of a source file: every node of a ``.py``; a Cython source's import and
    cimport lines, each parsed as Python's (a line in a docstring that is no statement is skipped)."""
    text = path.read_text()
    if path.suffix not in CYTHON_SUFFIXES:
        yield from ast.walk(ast.parse(text, str(path)))
        return
    for match in CYTHON_IMPORT.finditer(text):
        statement = re.sub(r"\bcimport\b", "import", match.group(0).strip())
        try:
            yield from ast.parse(statement).body
        except SyntaxError:
            continue


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the repository's modules it imports (anywhere in its source)."""
    mods = modules(root, packages)

    def deepest(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, paths in mods.items():
        package = name if paths[0].name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in (node for path in paths for node in import_nodes(path)):
            if isinstance(node, ast.Import):
                targets.update(deepest(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets.update(deepest(f"{base}.{alias.name}") for alias in node.names)
        parents = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets if t is not None and t != name and t not in parents}
        # The twin rule (fastcore.compiled_twin): a pure x.py picks its compiled _x by name, through
        # importlib, which no import statement shows: the edge is the rule's.
        head, _, last = name.rpartition(".")
        twin = f"{head}._{last}" if head else f"_{last}"
        if paths[0].suffix == ".py" and any(t.suffix == ".pyx" for t in mods.get(twin, ())):
            graph[name].add(twin)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def describe(graph: dict[str, set[str]], circle: frozenset[str]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & circle))}" for m in sorted(circle))


def test_no_import_circles() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert {
        "server.http.server",
        "fastcore.relay",
        "server.http._upstream",
    } <= graph.keys()  # it found the repository
    found = circles(graph)
    new = [describe(graph, c) for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circles: " + " | ".join(new)
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"no longer a circle, remove it from KNOWN_CIRCLES: {gone}"


def test_the_graph_sees_deferred_relative_and_type_only_imports(tmp_path: Path) -> None:
    """The detector on a small tree: each way of hiding a circle is still one."""
    files = {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "A = 1\ndef later():\n    from pkg import b  # deferred\n",
        "pkg/b.py": "from .a import A\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import D\n",
        "pkg/d.py": "import pkg.sub.c\nD = 1\n",
        "pkg/e.py": "from pkg.a import A\n",  # an import of a module is no circle
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.sub.c"] == {"pkg.d"} and graph["pkg"] == {"pkg.a"}
    assert sorted(sorted(c) for c in circles(graph)) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub.c"]]


def test_the_graph_reads_compiled_modules(tmp_path: Path) -> None:
    """A ``.pyx`` that imports back the module that imports it is a circle, as is one through a
    ``.pxd``'s cimport, or one back to the pure module that picks it by the twin rule; a docstring's
    "from ... import" prose and C libraries are no edge."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from ._b import B\n",
        "pkg/_b.pyx": '"""Twin of\nfrom the pure module: not an import.\n"""\nfrom libc.string cimport memcpy\n'
        "from .a import (\n    A,\n)\ncdef class B:\n    pass\n",
        "pkg/_c.pyx": "cimport cython\nfrom pkg._d cimport D\n",
        "pkg/_d.pxd": "from pkg cimport _c\ncdef class D:\n    pass\n",
        "pkg/_d.pyx": "import pkg.a\n",
        "pkg/e.py": "from fastcore import compiled_twin\n_compiled = compiled_twin('pkg._e')\n",
        "pkg/_e.pyx": "from pkg.e import NAME\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg._b"] == {"pkg.a"} and graph["pkg._d"] == {"pkg._c", "pkg.a"}
    assert graph["pkg.e"] == {"pkg._e"}  # a pure module picks its compiled twin (fastcore.compiled_twin)
    circles_found = sorted(sorted(c) for c in circles(graph))
    assert circles_found == [["pkg._b", "pkg.a"], ["pkg._c", "pkg._d"], ["pkg._e", "pkg.e"]]
