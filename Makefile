# The two commands a new user needs:  make demo   and   make test
# Each creates .venv itself from pyproject.toml; nothing else has to be installed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
ORDERS ?= 100

.PHONY: demo test lint typecheck unit integration chaos bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m devtools demo --orders $(ORDERS)

test: $(STAMP) lint typecheck
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest tests/unit

integration: $(STAMP)
	$(BIN)/pytest tests/integration

chaos: $(STAMP)
	$(BIN)/pytest tests/chaos

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
