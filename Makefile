PY ?= python

.PHONY: build test bench lint debug test-debug fuzz wheel plot gpu-check clean

build:          ## compile the Cython extensions in place
	$(PY) setup.py build_ext --inplace

test: build     ## whole suite, compiled and pure-Python twins
	FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q
	FASTCORE_NO_EXTENSIONS=1 $(PY) -m pytest -q

bench: build
	$(PY) -m bench.codec
	$(PY) -m bench.relay
	$(PY) -m bench.worker
	$(PY) -m bench.orchestrator_work
	$(PY) -m bench.orchestrator

lint:
	ruff check fastcore server bench tests
	ruff format --check fastcore server bench tests
	mypy

# AddressSanitizer + UBSan build of the extensions. libasan must be loaded
# before the interpreter, hence LD_PRELOAD; leak checking is off because
# CPython's own arenas look like leaks to LSan.
ASAN_LIB = $(shell gcc -print-file-name=libasan.so)
UBSAN_LIB = $(shell gcc -print-file-name=libubsan.so)
SAN_ENV = LD_PRELOAD="$(ASAN_LIB) $(UBSAN_LIB)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONMALLOC=malloc

debug:          ## ASan/UBSan build of the extensions, in place
	rm -f fastcore/_codec*.so fastcore/_jsonspan*.so
	FASTCORE_DEBUG_BUILD=1 $(PY) setup.py build_ext --inplace --force

test-debug: debug  ## compiled-twin tests under the sanitizers
	# test_codec.py whole: its per-SIMD-kernel tests have ids like [avx2], not [c].
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_codec.py
	# Scanner and relay whole: most of their ids are [c-...], and the twin-agreement tests have none.
	$(SAN_ENV) FASTCORE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_jsonspan.py tests/test_relay.py

fuzz: debug     ## hypothesis fuzz of the scanner under the sanitizers
	$(SAN_ENV) $(PY) -m tests.fuzz_jsonspan --seconds $${FUZZ_SECONDS:-120}

gpu-check: build  ## on a CUDA machine: the checkpoint tests (one needs CUDA) and the worker benchmark on the GPU
	$(PY) -m pytest -q tests/test_hf_checkpoints.py tests/test_worker_cli.py
	$(PY) -m bench.worker --device cuda

wheel:
	$(PY) -m build

plot:
	$(PY) -m bench.load --compare --concurrency 16,64,256,1024

clean:
	rm -rf build dist *.egg-info fastcore/*.so fastcore/_codec.c fastcore/_jsonspan.c
