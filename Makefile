# One command for each thing a person does. Python and pip are the machine's own;
# torch is pinned first so that pip takes the local CPU wheel, not a multi-GB CUDA build.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup setup-dev models-ci models demo test test-fast bench bench-quick lint clean

setup:  ## install Tandem (CPU torch first)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e .

setup-dev: setup  ## install Tandem with test and benchmark dependencies
	$(PIP) install -q -e ".[dev,bench]"

models-ci: setup  ## the small real model the tests use (SmolLM2-135M, ~100 MB)
	$(PYTHON) -m tandem models prepare smollm2

models: setup  ## the benchmark pair (Qwen2.5-Coder 1.5B target, 0.5B draft; ~1.6 GB download)
	$(PYTHON) -m tandem models prepare qwen-coder-0.5b qwen-coder-1.5b

demo: models  ## generate text with the default models, speculatively
	$(PYTHON) -m tandem generate "$(PROMPT)" --chat --target qwen-coder-1.5b --draft qwen-coder-0.5b --max-new-tokens 96

test: setup-dev models-ci  ## the whole test suite (unit + integration on real models)
	$(PYTHON) -m pytest -q

test-fast: ## unit tests only, no model downloads
	$(PYTHON) -m pytest -q -m "not slow"

bench: setup-dev models  ## engine and speculative-decoding benchmarks (slow: tens of minutes)
	$(PYTHON) benchmarks/engine_speed.py
	$(PYTHON) benchmarks/spec_bench.py

bench-quick: setup-dev models
	$(PYTHON) benchmarks/engine_speed.py --quick
	$(PYTHON) benchmarks/spec_bench.py --quick

lint:
	$(PYTHON) -m ruff check tandem tests benchmarks || true

clean:
	rm -rf build *.egg-info .pytest_cache
