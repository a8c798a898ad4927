# Two commands for a new user: `make run` (gateway with the demo model and SQLite) and
# `make test` (the whole test suite, as CI runs it). `make draft` distils the demo's draft
# (about a quarter of an hour on 2 cores); until then the demo speculates with n-gram lookup.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run demo draft test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel first: a looser requirement would make pip fetch a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specgate models build-demo --target-only

draft: $(STAMP)
	$(BIN)/specgate models build-demo

run: demo
	$(BIN)/specgate serve

lint: $(STAMP)
	$(BIN)/ruff check engine gateway bench migrations tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

bench: demo
	$(BIN)/specgate bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
