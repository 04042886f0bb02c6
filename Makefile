# Two commands on a fresh machine: `make run` (train the default model) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test`: two halve the default suite's wall time on the 2-core CI machine (a test
# spends much of its time compiling in one Python thread); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2

.PHONY: run test lint test-slow test-gpu bench docs clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

run: $(STAMP)  ## train the default small GPT-2 on the embedded corpus (again: continue or report runs/default)
	$(BIN)/graphtrain train --resume auto

test: lint  ## the lint, then the default test suite (slow checks excluded)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)  ## ruff (lint and format) over src/ and tests/, mypy over the graph floors (pyproject.toml)
	$(BIN)/ruff check src tests scripts docs
	$(BIN)/ruff format --check src tests scripts docs
	$(BIN)/mypy

test-slow: $(STAMP)  ## only the slow checks
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile

test-gpu: $(STAMP)  ## only the tests that need an NVIDIA GPU (a GPU machine from source: scripts/gpu-check.sh)
	$(BIN)/python -m pytest -q -m cuda

bench: $(STAMP)  ## the small benchmark suite
	$(BIN)/graphtrain bench small

docs: $(STAMP)  ## the documentation site into build/site (mkdocs build --strict: warnings are errors)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs bench_results .pytest_cache
