"""Build the Cython extensions; all metadata lives in pyproject.toml.

FASTCORE_DEBUG_BUILD=1 builds with AddressSanitizer/UBSan (``make debug``).
"""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("FASTCORE_DEBUG_BUILD") == "1"

compile_args = ["-O3", "-fno-strict-aliasing"]
link_args: list[str] = []
if sys.platform == "win32":
    compile_args = ["/O2"]
elif debug:
    sanitize = "-fsanitize=address,undefined"
    compile_args = ["-O1", "-g", "-fno-omit-frame-pointer", sanitize, "-fno-sanitize-recover=undefined"]
    link_args = [sanitize]

extensions = [
    Extension(
        "fastcore._codec",
        ["fastcore/_codec.pyx", "fastcore/_b64simd.c"],
        include_dirs=["fastcore"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ),
    Extension(
        "fastcore._jsonspan",
        ["fastcore/_jsonspan.pyx"],
        include_dirs=["fastcore"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": debug,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": debug,
            "embedsignature": True,
        },
    )
)
