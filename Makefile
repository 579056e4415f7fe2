# One command for each thing a person does. Python and pip are the machine's own;
# torch is pinned first so that pip takes the local CPU wheel, not a multi-GB CUDA build.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup setup-dev models-ci models demo test test-fast bench bench-quick lint clean

setup:  ## install Tandem (CPU torch first) and generate the gRPC stubs
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e .
	$(PYTHON) -m tandem.proto_build

setup-dev: setup  ## install Tandem with test and benchmark dependencies
	$(PIP) install -q -e ".[dev,bench]"

models-ci: setup  ## the small real model the tests use (SmolLM2-135M, ~100 MB)
	$(PYTHON) -m tandem models prepare smollm2

models: setup  ## the benchmark pair (Qwen2.5-Coder 1.5B target, 0.5B draft; ~1.6 GB download)
	$(PYTHON) -m tandem models prepare qwen-coder-0.5b qwen-coder-1.5b

demo: models  ## start the whole system locally (workers + coordinator), stream one answer over gRPC, stop
	$(PYTHON) -m tandem demo "$(PROMPT)"

test: setup-dev models-ci  ## the whole test suite (unit + integration on real models)
	$(PYTHON) -m pytest -q

test-fast: ## unit tests only, no model downloads
	$(PYTHON) -m pytest -q -m "not slow"

bench: setup-dev models  ## every benchmark (slow: about an hour on 2 cores)
	$(PYTHON) benchmarks/engine_speed.py
	$(PYTHON) benchmarks/spec_bench.py
	$(PYTHON) benchmarks/greedy_equivalence.py
	$(PYTHON) benchmarks/distributed_bench.py

bench-quick: setup-dev models
	$(PYTHON) benchmarks/engine_speed.py --quick
	$(PYTHON) benchmarks/spec_bench.py --quick
	$(PYTHON) benchmarks/distributed_bench.py --quick

lint:
	$(PYTHON) -m ruff check tandem tests benchmarks || true

clean:
	rm -rf build *.egg-info .pytest_cache
