#!/usr/bin/env bash
# The compatibility matrix of docs/compatibility.md: each job a Python, a set of pinned (or newest) releases and
# one Postgres driver, in its own virtualenv .venv-matrix-<job>/, running the test subset that exercises them.
#
#   ci/matrix.sh install JOB   create .venv-matrix-JOB and install the checkout with the job's releases
#   ci/matrix.sh test JOB      print what is installed, then run the job's tests
#   ci/matrix.sh jobs          list the jobs `make test` runs (`make test-matrix`)
#
# `make test-matrix-<job>` runs one job; `make test` runs every one (docs/compatibility.md, "What CI runs").
# Under CI=true a job whose Python is missing fails; locally it is skipped with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."

JOBS="oldest newest"  # every job: `make test` runs them all

# The subset every job runs, the tests of the code that meets each dependency (the whole suite runs on .venv):
# SQLAlchemy (write side, relay, inbox, migrations), Celery/kombu (publishing, the consumer task, the
# recommended configuration), Flask (the extension, the web app), the Postgres driver (claims, NOTIFY, its
# errors), and the Django suite on the job's Django.
TESTS=(
  tests/unit/test_write_side.py tests/unit/test_outbox_api.py tests/unit/test_front_doors.py
  tests/unit/test_relay_dispatch.py tests/unit/test_relay_order.py tests/unit/test_relay_failures.py
  tests/unit/test_relay_kombu_memory.py tests/unit/test_kombu_nacks.py tests/unit/test_recommended_config.py
  tests/unit/test_inbox_claim.py tests/unit/test_consumer_inbox.py tests/unit/test_consumer_ordering.py
  tests/unit/test_consumer_tasks.py tests/unit/test_consumer_dead_letters.py tests/unit/test_unique_violation.py
  tests/unit/test_db_engine.py tests/unit/test_migrations.py tests/unit/test_alembic_helpers.py
  tests/unit/test_testing_surface.py tests/unit/test_flask_extension.py tests/unit/test_web.py
  tests/unit/test_receipts_pg.py tests/unit/test_ops_stats.py tests/unit/test_ops_dead_letters.py
  tests/integration/test_relay_postgres.py
  tests/django
)

job() {  # sets PYVER, PACKAGES, CONSTRAINTS, DESELECT for job $1
  case "$1" in
    oldest)  # Python 3.11, the lowest release of every range, psycopg2 only, Django 5.2 LTS, Flask 3.0
      PYVER=3.11
      PACKAGES=(-e ".[psycopg2,redis,flask,django,otel]")
      CONSTRAINTS=(-c ci/constraints-oldest.txt)
      DESELECT="not psycopg- and not [psycopg]" ;;  # the tests parametrized by driver: psycopg2's only
    newest)  # Python 3.13, the newest release each range admits, psycopg 3 only (postgresql:// takes it), Django 6
      PYVER=3.13
      PACKAGES=(-e ".[psycopg,redis,flask,django,otel]" "django>=6")
      CONSTRAINTS=()
      DESELECT="not psycopg2" ;;  # the tests parametrized by driver: psycopg 3's only
    *) echo "ci/matrix.sh: unknown job '$1' (jobs: oldest newest)" >&2; exit 2 ;;
  esac
}

find_python() {  # python3.X on PATH, else pyenv's newest 3.X (a pyenv shim with none active fails)
  local v=$1 p
  if p=$("python$v" -c 'import sys; print(sys.executable)' 2>/dev/null); then echo "$p"; return; fi
  for p in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V -r); do
    if "$p" -c 'pass' 2>/dev/null; then echo "$p"; return; fi
  done
  return 1
}

ci_true() { case "${CI:-}" in 1|true|yes) return 0 ;; esac; return 1; }

cmd=${1:-}; name=${2:-}
case "$cmd" in
  jobs) echo "$JOBS"; exit 0 ;;
  install|test) [ -n "$name" ] || { echo "usage: ci/matrix.sh install|test JOB" >&2; exit 2; } ;;
  *) echo "usage: ci/matrix.sh install|test|jobs [JOB]" >&2; exit 2 ;;
esac
job "$name"
VENV=.venv-matrix-$name

if ! PY=$(find_python "$PYVER"); then
  msg="ci/matrix.sh $name: python$PYVER is not on this machine"
  if ci_true; then echo "$msg" >&2; exit 1; fi
  echo "$msg: skipped" >&2; exit 0
fi

if [ "$cmd" = install ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "${PACKAGES[@]}" -r ci/requirements-test.txt
  touch "$VENV/.installed-stamp"
  exit 0
fi

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, sys
names = ["celery", "kombu", "sqlalchemy", "alembic", "django", "flask", "werkzeug", "psycopg2-binary", "psycopg",
         "redis", "click"]
have = []
for n in names:
    try:
        have.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        have.append(f"{n} -")
print(f"matrix: Python {sys.version.split()[0]}; " + ", ".join(have))
EOF
# Python 3.13 warns of a SQLite connection left to the garbage collector (3.11 does not): ignored here, as
# pyproject.toml ignores the unclosed socket, so that a GC timing is not a failure of this job.
exec "$VENV/bin/pytest" -q -p no:cacheprovider -W "ignore:unclosed database in <sqlite3.Connection:ResourceWarning" \
  -k "$DESELECT" "${TESTS[@]}"
