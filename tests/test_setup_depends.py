"""setup.py's build of a pure-Python source compiled in Cython's pure-Python mode under another name
(``server/http/upstream.py`` as ``server.http._upstream``, typed by ``_upstream.pxd``): Cython's own
dependency tree does not see that ``.pxd`` nor what it cimports, so setup.py removes the generated C
when one of them is newer (else a changed ``_parse.pxd`` left ``_upstream`` built against the old
``ResponseParser``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import setuptools

ROOT = Path(__file__).resolve().parent.parent


def _setup_namespace(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """setup.py's functions, without building anything (setup() a no-op, no extensions)."""
    monkeypatch.setenv("FASTCORE_NO_EXTENSIONS", "1")
    monkeypatch.delenv("FASTCORE_REQUIRE_EXTENSIONS", raising=False)
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    namespace: dict[str, Any] = {"__name__": "setup_under_test", "__file__": str(ROOT / "setup.py")}
    exec(compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec"), namespace)
    return namespace


def test_a_newer_augmenting_pxd_or_one_it_cimports_remakes_the_generated_c(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    remake = _setup_namespace(monkeypatch)["_remake_stale_pure_mode_c"]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_base.pxd").write_text("cdef class Base:\n    cdef int n\n")
    (pkg / "_mod.pxd").write_text("from pkg._base cimport Base\n\ncdef class Mod(Base):\n    pass\n")
    (pkg / "mod.py").write_text("class Mod:\n    pass\n")
    generated = pkg / "mod.c"
    generated.write_text("/* generated */\n")
    monkeypatch.chdir(tmp_path)
    modules = {"pkg._mod": ["pkg/mod.py"], "pkg._other": ["pkg/other.pyx"]}
    for name in ("_base.pxd", "_mod.pxd", "mod.py"):
        os.utime(pkg / name, (1_000_000, 1_000_000))
    remake(modules)
    assert generated.exists()  # older than its C: kept
    os.utime(pkg / "_base.pxd", (2_000_000_000, 2_000_000_000))  # what _mod.pxd cimports changed
    remake(modules)
    assert not generated.exists()
    generated.write_text("/* generated */\n")
    os.utime(pkg / "_base.pxd", (1_000_000, 1_000_000))
    os.utime(pkg / "_mod.pxd", (2_000_000_000, 2_000_000_000))  # the augmenting .pxd changed
    remake(modules)
    assert not generated.exists()
