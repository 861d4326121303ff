"""Build the Cython extensions; all metadata lives in pyproject.toml.

Every compiled module has a pure-Python twin, so the extensions are an
optimisation, not a requirement:

- when they cannot be built (no C compiler, a compiler that fails, no
  Cython), the build says so in one line and goes on without them: the
  wheel is then pure (``py3-none-any``) and ``fastcore.backend`` is
  ``"python"``;
- ``FASTCORE_NO_EXTENSIONS=1`` builds the pure package without trying;
- ``FASTCORE_REQUIRE_EXTENSIONS=1`` makes a failed build an error (CI, release
  wheels, ``make build``).

These are the variables ``fastcore/__init__.py`` and ``tests/conftest.py``
read at run time, with the same meaning at build time.

Release flags: the objects are compiled without debug info (``-g0`` after
the interpreter's own ``-g``) and linked with ``--strip-debug``, so a wheel's
``.so`` files carry code and symbols only: not "stripped" in ``file``'s sense,
the symbol table (``.symtab``, tens of KB per module) is kept on purpose so that perf
and gdb name the SIMD kernels in a production profile. FASTCORE_DEBUG_BUILD=1 builds with
debug info and AddressSanitizer/UBSan instead (``make debug``).
"""

import os
import re
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


NO_EXTENSIONS = _flag("FASTCORE_NO_EXTENSIONS")
REQUIRE_EXTENSIONS = _flag("FASTCORE_REQUIRE_EXTENSIONS")
DEBUG = os.environ.get("FASTCORE_DEBUG_BUILD") == "1"

if NO_EXTENSIONS and REQUIRE_EXTENSIONS:
    sys.exit("FASTCORE_NO_EXTENSIONS=1 and FASTCORE_REQUIRE_EXTENSIONS=1 contradict each other: set one")


def _fallback_line(reason: str) -> str:
    return (
        f"fastcore-serve: C extensions not built ({reason}): installing the pure-Python twins"
        " (fastcore.backend == 'python'); FASTCORE_REQUIRE_EXTENSIONS=1 makes this an error"
    )


class build_ext_or_pure(build_ext):
    """build_ext that falls back to the pure-Python twins when compiling fails.

    On a failure no compiled module is kept, not even one that did build:
    ``fastcore`` loads the two compiled twins together or neither, and a pure
    wheel must carry no ``.so``.
    """

    _building = "the extensions"

    def build_extensions(self) -> None:
        # Some interpreters (pyenv's, for one) link extensions with
        # -Wl,-rpath to their own lib directory: a path on the build machine
        # that would be baked into the wheel's .so as a RUNPATH. The
        # extensions need no library but libc, so they take no rpath.
        linker = getattr(self.compiler, "linker_so", None)
        if linker:
            self.compiler.linker_so = [a for a in linker if not a.startswith(("-Wl,-rpath", "-Wl,-R"))]
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        self._building = ext.name
        super().build_extension(ext)

    def run(self) -> None:
        inplace = self.inplace  # setuptools clears it while building, and restores it only on success
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError) as exc:
            if REQUIRE_EXTENSIONS:
                raise
            self.inplace = inplace
            self._drop_extensions(f"{self._building}: {self._short_reason(exc)}")

    def _short_reason(self, exc: Exception) -> str:
        # A failed compile's message repeats the whole command line; say
        # which program failed and how instead.
        detail = str(exc)
        status = re.search(r"returned non-zero exit status (-?\d+)", detail)
        compiler = getattr(self.compiler, "compiler_so", None) or ["the compiler"]
        if status:
            detail = f"{compiler[0]} exited with status {status.group(1)}"
        elif len(detail) > 160:
            detail = detail[:157] + "..."
        return f"{type(exc).__name__}, {detail}"

    def _drop_extensions(self, reason: str) -> None:
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            stale = [regular_file, inplace_file] if self.inplace else [regular_file]
            for path in stale:
                if os.path.exists(path):
                    os.remove(path)
        self.extensions = []
        self.distribution.ext_modules = []
        print(_fallback_line(reason), file=sys.stderr, flush=True)


class bdist_wheel_or_pure(bdist_wheel):
    """bdist_wheel whose tag follows what was built: ``py3-none-any`` without extensions.

    bdist_wheel decides purity from the declared extensions before anything
    is built; build first, then decide from what build_ext kept.
    """

    def run(self) -> None:
        if NO_EXTENSIONS:
            print(
                "fastcore-serve: FASTCORE_NO_EXTENSIONS=1: a pure-Python wheel", file=sys.stderr, flush=True
            )
        if not self.skip_build:
            self.run_command("build")
        if not self.distribution.has_ext_modules():
            self.root_is_pure = True
        super().run()


def _remake_stale_pure_mode_c(modules: dict[str, list[str]]) -> None:
    """Cython's dependency tree reads the ``.pxd`` beside a source of the same name (``x.py``:
    ``x.pxd``), not the one that types a pure-Python source compiled under another name
    (``upstream.py`` as ``_upstream``: ``_upstream.pxd``), nor what that one cimports (``_parse.pxd``,
    whose ``ResponseParser`` the compiled connection subclasses): such a module's generated C is
    removed, so made again, when one of those is newer than it."""
    from Cython.Build.Dependencies import create_dependency_tree

    tree = create_dependency_tree()
    for name, (source, *_) in modules.items():
        pxd = os.path.join(os.path.dirname(source), name.rsplit(".", 1)[1] + ".pxd")
        generated = source[:-3] + ".c"
        if not source.endswith(".py") or not os.path.exists(pxd) or not os.path.exists(generated):
            continue
        if max(os.path.getmtime(dep) for dep in tree.all_dependencies(pxd)) > os.path.getmtime(generated):
            os.remove(generated)


def _extensions() -> list[Extension]:
    if NO_EXTENSIONS:
        return []
    try:
        from Cython.Build import cythonize
    except ImportError as exc:
        # Cython is a build requirement (pyproject.toml), so only a
        # --no-build-isolation build without it gets here.
        if REQUIRE_EXTENSIONS:
            raise
        print(_fallback_line(f"Cython not importable: {exc}"), file=sys.stderr, flush=True)
        return []

    compile_args = ["-O3", "-g0", "-fno-strict-aliasing"]
    link_args: list[str] = ["-Wl,--strip-debug"] if sys.platform.startswith("linux") else []
    if sys.platform == "win32":
        compile_args = ["/O2"]
        link_args = []
    elif DEBUG:
        sanitize = "-fsanitize=address,undefined"
        compile_args = ["-O1", "-g", "-fno-omit-frame-pointer", sanitize, "-fno-sanitize-recover=undefined"]
        link_args = [sanitize]

    # fastcore's C lives in fastcore/include/ (declared in each module's .pxd); a module that
    # calls b64simd.c's kernels compiles it in. server/http/_llhttp.pyx (what both HTTP parsers
    # share) compiles in llhttp, once for the process (the parsers call it through _llhttp.pxd),
    # vendored outside the packages (third_party/llhttp/README.md) so that no wheel carries its
    # sources.
    include = "fastcore/include"
    llhttp = "third_party/llhttp"
    headers = sorted(os.path.join(include, name) for name in os.listdir(include) if name.endswith(".h"))
    modules = {
        "fastcore._codec": ["fastcore/_codec.pyx", f"{include}/b64simd.c"],
        "fastcore._scan": ["fastcore/_scan.pyx"],
        "fastcore._relay": ["fastcore/_relay.pyx"],
        "fastcore._hash": ["fastcore/_hash.pyx"],
        "server.http._llhttp": ["server/http/_llhttp.pyx"]
        + [f"{llhttp}/src/{name}" for name in ("llhttp.c", "api.c", "http.c")],
        # the HTTP parsers on it: the request parser, and the response parser (_parse exports both)
        "server.http._request_parser": ["server/http/_request_parser.pyx"],
        "server.http._parse": ["server/http/_parse.pyx"],
        # the upstream connection, response, deadline sweeper and pool start: their pure source compiled
        # in Cython's pure-Python mode (typed by _upstream.pxd: the connection a subclass of _parse's
        # ResponseParser); upstream.py picks them
        "server.http._upstream": ["server/http/upstream.py"],
        # the orchestrator's per-request counts, their pure source compiled in Cython's pure-Python
        # mode (typed by _tally.pxd; server/orchestrator/twins.py picks them, as the next two)
        "server.orchestrator._tally": ["server/orchestrator/tally.py"],
        # estimates' BytesPerToken, the same way (typed by _bytes_per_token.pxd)
        "server.orchestrator._bytes_per_token": ["server/orchestrator/bytes_per_token.py"],
        # pools' CircuitBreaker, the same way (typed by _breaker.pxd)
        "server.orchestrator._breaker": ["server/orchestrator/breaker.py"],
        # the fleet's shared counts: GCC atomics on the --workers N processes' mapping (fleet.py picks it)
        "server.orchestrator._fleet": ["server/orchestrator/_fleet.pyx"],
        # the torch worker forward's CPU kernels (norms, SiLU, rotary, paged decode attention), its
        # C beside it (cpu_kernels.py picks it; the wheel's codec and scanner never import it)
        "server.worker._cpu_kernels": ["server/worker/_cpu_kernels.pyx", "server/worker/cpu_decode.c"],
    }
    _remake_stale_pure_mode_c(modules)
    # cpu_decode.c's float kernels: no FMA contraction (every build adds the same numbers: the same
    # results on any CPU), no trapping math (its clamps then vectorise; nothing here reads FP flags)
    float_args = {"server.worker._cpu_kernels": ["-ffp-contract=off", "-fno-trapping-math"]}
    extensions = [
        Extension(
            name,
            sources,
            include_dirs=[include, f"{llhttp}/include", "server/worker"],
            depends=[*headers, f"{llhttp}/include/llhttp.h", "server/worker/cpu_decode.h"],
            extra_compile_args=compile_args + (float_args.get(name, []) if sys.platform != "win32" else []),
            extra_link_args=link_args,
        )
        for name, sources in modules.items()
    ]
    return cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": DEBUG,
            # a None where a typed object is expected raises instead of crashing: everywhere in the
            # sanitized build; in the release build where a module says so in its header
            # (server/http/upstream.py, compiled as _upstream: its connection's events and responses, at no
            # measured cost)
            "nonecheck": DEBUG,
            "embedsignature": True,
        },
    )


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": build_ext_or_pure, "bdist_wheel": bdist_wheel_or_pure},
)
