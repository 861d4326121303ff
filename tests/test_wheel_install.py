"""The wheel a user installs: built from a copy of this tree, installed in a
fresh venv outside it, with the codec and scanner tests run from there.

Which wheel follows the run, so that CI's two runs test two wheels rather
than one twice:

- by default (CI's first run, FASTCORE_REQUIRE_EXTENSIONS=1): the compiled
  wheel, its tests run with the compiled twins required;
- under FASTCORE_NO_EXTENSIONS=1 (CI's second run): the wheel a machine
  without a C compiler builds (CC=/bin/false), which must fall back to the
  pure-Python twins with one line saying so, be tagged ``py3-none-any`` and
  carry no ``.so``.

The wheels here are plain ``pip wheel`` builds (no manylinux repair, no build
isolation: the build requirements are in the ``test`` extra); the manylinux
wheel is ``make wheel``'s, checked by ``make check-dist`` in ``.ci/run``.

The venv is a plain one: the wheel with its dependency (numpy), pytest and
hypothesis, at the versions this environment has (so pip's cache serves
them). Not ``--system-site-packages``: an editable install of this project in
the outer environment puts a finder on ``sys.meta_path`` that answers for
``fastcore._codec`` whenever the installed package lacks it, so a pure wheel
would still load a tree's compiled twins. The tests check where every loaded
fastcore module comes from.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import fastcore

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COMPILED = not fastcore.NO_EXTENSIONS
FALLBACK_LINE = "fastcore-serve: C extensions not built ("
# What a build needs from the tree; the rest of it (tests, bench) is not in the wheel.
COPIED = [
    "setup.py",
    "pyproject.toml",
    "MANIFEST.in",
    "README.md",
    "LICENSE",
    "fastcore",
    "server",
    "third_party",
]
# The C that Cython generates is regenerated, as from an sdist.
IGNORED = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so", "*.html", "_codec.c", "_scan.c", "_relay.c", "_hash.c", "_parse.c", "_llhttp.c", "_request_parser.c", "_upstream.c", "tally.c", "_fleet.c", "bytes_per_token.c", "breaker.c", "_cpu_kernels.c")
# Each subprocess gets these from the test, never from the environment it runs in.
OWN_ENV = (
    "FASTCORE_NO_EXTENSIONS",
    "FASTCORE_REQUIRE_EXTENSIONS",
    "FASTCORE_DEBUG_BUILD",
    "CC",
    "PYTHONPATH",
)
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OWN_ENV}
    env.update(extra)
    return env


def run(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        out, err = proc.stdout[-6000:], proc.stderr[-6000:]
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}")
    return proc


def copy_tree(dest: Path) -> Path:
    dest.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=IGNORED)
        else:
            shutil.copy2(src, dest / name)
    return dest


def build_wheel(src: Path, out: Path, **env: str) -> tuple[Path, str]:
    """``pip wheel`` of ``src`` into ``out``; the wheel and the build's output."""
    proc = run(
        [*PIP_WHEEL, "-v", "--wheel-dir", str(out), str(src)],
        cwd=src,
        env=clean_env(**env),
    )
    (wheel,) = out.glob("*.whl")
    return wheel, proc.stdout + proc.stderr


@dataclass
class Installed:
    src: Path  # the copy of the tree the wheel was built from
    wheel: Path
    build_log: str
    venv: Path
    python: Path
    tests: Path  # a copy of the tests, outside the repository


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if COMPILED and shutil.which(sysconfig.get_config_var("CC").split()[0]) is None:
        pytest.skip("no C compiler to build the compiled wheel with")
    base = tmp_path_factory.mktemp("wheel_install")
    assert ROOT not in base.parents, "the venv and the tests must live outside the tree"
    src = copy_tree(base / "src")
    if COMPILED:
        wheel, log = build_wheel(src, base / "dist", FASTCORE_REQUIRE_EXTENSIONS="1")
    else:
        wheel, log = build_wheel(src, base / "dist", CC="/bin/false")

    venv = base / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=base, env=clean_env())
    python = venv / "bin" / "python"
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in ("numpy", "pytest", "hypothesis")]
    run([str(python), "-m", "pip", "install", "--quiet", str(wheel), *pins], cwd=base, env=clean_env())

    # conftest.py finds the JSON corpus at tests/data: copy it beside the tests.
    project = base / "project"
    (project / "tests").mkdir(parents=True)
    for name in ("conftest.py", "helpers.py", "test_codec.py", "test_jsonspan.py"):
        shutil.copy2(ROOT / "tests" / name, project / "tests" / name)
    shutil.copytree(ROOT / "tests" / "data", project / "tests" / "data")
    (project / "pytest.ini").write_text(
        "[pytest]\naddopts = -ra --strict-markers -p no:cacheprovider\n"
        "markers =\n    slow: long-running tests (large inputs, live processes)\n"
    )
    return Installed(src, wheel, log, venv, python, project / "tests")


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_tag_and_contents(installed: Installed, tmp_path: Path) -> None:
    names = wheel_names(installed.wheel)
    sos = [n for n in names if n.endswith(".so")]
    assert "fastcore_serve-0.1.0.dist-info/licenses/LICENSE" in names
    with zipfile.ZipFile(installed.wheel) as zf:
        metadata = zf.read("fastcore_serve-0.1.0.dist-info/METADATA").decode()
        wheel_file = zf.read("fastcore_serve-0.1.0.dist-info/WHEEL").decode()
        assert zf.read("fastcore_serve-0.1.0.dist-info/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    # MIT: llhttp, compiled into server.http._parse
    assert "License-Expression: Apache-2.0 AND MIT" in metadata.splitlines()
    assert "fastcore_serve-0.1.0.dist-info/licenses/third_party/llhttp/LICENSE-MIT" in names
    assert not [n for n in names if n.endswith((".pyx", ".pxd", ".c", ".h"))], "sources go in the sdist only"
    if COMPILED:
        assert not installed.wheel.name.endswith("-py3-none-any.whl")
        assert sorted(n.split(".")[0] for n in sos) == [
            "fastcore/_codec", "fastcore/_hash", "fastcore/_relay", "fastcore/_scan", "server/http/_llhttp",
            "server/http/_parse", "server/http/_request_parser", "server/http/_upstream",
            "server/orchestrator/_breaker", "server/orchestrator/_bytes_per_token",
            "server/orchestrator/_fleet", "server/orchestrator/_tally", "server/worker/_cpu_kernels",
        ]  # fmt: skip
        assert FALLBACK_LINE not in installed.build_log
        with zipfile.ZipFile(installed.wheel) as zf:
            zf.extractall(tmp_path, members=sos)
        for so in sos:
            sections = subprocess.run(
                ["readelf", "-S", "--wide", str(tmp_path / so)], capture_output=True, text=True, check=True
            ).stdout
            assert ".debug_" not in sections, f"{so} keeps debug info"
            dynamic = subprocess.run(
                ["readelf", "-d", str(tmp_path / so)], capture_output=True, text=True, check=True
            ).stdout
            assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, f"{so} keeps a build machine's path"
    else:
        assert installed.wheel.name == "fastcore_serve-0.1.0-py3-none-any.whl"
        assert "Root-Is-Purelib: true" in wheel_file.splitlines()
        assert sos == []
        lines = [line for line in installed.build_log.splitlines() if FALLBACK_LINE in line]
        assert len(lines) == 1, installed.build_log[-4000:]
        assert "/bin/false exited with status 1" in lines[0]
        assert "installing the pure-Python twins" in lines[0]


def test_fastcore_comes_from_the_wheel(installed: Installed) -> None:
    probe = (
        "import fastcore, json, sys; print(json.dumps([fastcore.backend,"
        " {n: m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'fastcore'}]))"
    )
    out = run([str(installed.python), "-c", probe], cwd=installed.tests.parent, env=clean_env()).stdout
    backend, files = json.loads(out.strip().splitlines()[-1])
    twins = {"fastcore._codec", "fastcore._scan", "fastcore._relay", "fastcore._hash"}
    assert "fastcore" in files
    assert twins <= files.keys() if COMPILED else not twins & files.keys()
    for name, where in files.items():
        assert Path(where).resolve().is_relative_to(installed.venv.resolve()), (
            f"{name} imported from {where}, not the venv"
        )
    if COMPILED:
        assert backend.startswith("cython ("), backend
    else:
        assert backend == "python"


def test_codec_and_scanner_tests_pass_from_the_installed_wheel(installed: Installed) -> None:
    # Compiled wheel: the compiled twins must import (REQUIRE); pure wheel: no
    # flag at all, the compiled cases skip since the wheel has no .so.
    env = clean_env(FASTCORE_REQUIRE_EXTENSIONS="1") if COMPILED else clean_env()
    proc = run(
        [str(installed.python), "-m", "pytest", "-q", "-rs", "tests/test_codec.py", "tests/test_jsonspan.py"],
        cwd=installed.tests.parent,
        env=env,
        timeout=280,
    )
    summary = proc.stdout.strip().splitlines()[-1]
    print(f"from the installed wheel: {summary}")
    assert " passed" in summary and "failed" not in summary and "error" not in summary, proc.stdout[-3000:]
    if COMPILED:
        # REQUIRE turns a missing compiled twin into a failure; what may skip is
        # what this venv lacks on purpose (torch) or the CPU cannot run.
        skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
        assert not [s for s in skips if "torch" not in s and "this CPU cannot run" not in s], skips


@pytest.mark.skipif(COMPILED, reason="the no-compiler build's twin check; runs with FASTCORE_NO_EXTENSIONS=1")
def test_require_extensions_makes_a_failed_build_an_error(installed: Installed, tmp_path: Path) -> None:
    # The copy the pure wheel came from: Cython's C is there already.
    proc = subprocess.run(
        [*PIP_WHEEL, "--wheel-dir", str(tmp_path / "dist"), str(installed.src)],
        cwd=installed.src,
        env=clean_env(CC="/bin/false", FASTCORE_REQUIRE_EXTENSIONS="1"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode != 0, "FASTCORE_REQUIRE_EXTENSIONS=1 built a wheel without a compiler"
    assert not list((tmp_path / "dist").glob("*.whl"))
