# qlbench: every target sets up what it needs in ./.venv first (CPU build of torch 2.13.0, then the package).
#   make run      the main job: dropwave on the deep-narrow backbone, every method, `quick` budget
#   make test     the default test suite (what CI runs, after make lint)
#   make lint     ruff: lint and format check
#   make figures  regenerate figures/ from the notebooks
#   make bench    speed benchmarks (side by side, one run)
#   make results-snapshot  the quick deep-narrow sweep (9 functions, every method) and its report in docs/results
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and pinned: a bare `torch` requirement with no torch installed pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup setup-dev run test test-slow lint format figures bench results-snapshot clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.runtime
setup-dev: $(VENV)/.dev

run: setup
	$(BIN)/qlbench run --function dropwave --arch deep-narrow --budget quick

test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check qlbench tests
	$(BIN)/ruff format --check qlbench tests

format: setup-dev
	$(BIN)/ruff check --fix qlbench tests
	$(BIN)/ruff format qlbench tests

test-slow: setup-dev
	$(BIN)/python -m pytest -q -m slow

figures: setup-dev
	cd notebooks && ../$(BIN)/jupyter execute 01_function_zoo.ipynb

bench: setup
	$(BIN)/qlbench bench

results-snapshot: setup
	$(BIN)/qlbench sweep --arch deep-narrow --budget quick --threads 1 --out results
	$(BIN)/qlbench report results --arch deep-narrow --budget quick --out docs/results

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
