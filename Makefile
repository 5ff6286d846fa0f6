# One entry point for people and CI. `make test` and `make demo` set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint demo sim-demo sweep rdma-test bench clean

$(STAMP): pyproject.toml setup.py $(wildcard native/*.c native/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The suite runs once on the native hot path, then the hot-path, transport, runtime and protocol
# tests again on its pure-Python twin (the fallback when the C extension is missing), less those
# marked `once` (nothing in them depends on the hot path: see pyproject.toml).
PURE_TESTS := tests/hotpath tests/transport tests/runtime tests/test_scenarios.py tests/test_sim_api.py

test: lint
	$(BIN)/pytest
	DERECHO_ASYNC_PURE_PYTHON=1 $(BIN)/pytest -p no:cacheprovider -m "not once" $(PURE_TESTS)

demo: $(STAMP)
	$(BIN)/derecho-async demo

sim-demo: $(STAMP)
	$(BIN)/python examples/sim_demo.py

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/compare.py

rdma-test: $(STAMP)
	scripts/rdma-tests.sh

sweep: $(STAMP)
	$(BIN)/python -m derecho_async.testing.sweep --count 100000

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
