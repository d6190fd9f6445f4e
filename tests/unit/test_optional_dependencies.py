"""Either Postgres driver alone, and a missing driver or broker client named by its extra in one line."""

from __future__ import annotations

import sys

import pytest

from celery_outbox import make_engine
from celery_outbox.celery.config import require_broker_client
from celery_outbox.db import normalize_url, postgres_driver
from celery_outbox.errors import MissingExtraError

URL = "postgresql://nobody@127.0.0.1:1/none"


def hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ModuleNotFoundError, find_spec is None


def test_a_plain_postgresql_url_takes_psycopg2_when_it_is_installed() -> None:
    assert postgres_driver() == "psycopg2"
    assert make_engine(URL).dialect.driver == "psycopg2"


def test_a_plain_postgresql_url_takes_psycopg_3_when_it_is_the_only_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given psycopg 3 alone ([psycopg])
    hide(monkeypatch, "psycopg2")
    # Then postgresql:// and postgres:// run on it
    assert normalize_url(URL).startswith("postgresql+psycopg://")
    assert normalize_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert make_engine(URL).dialect.driver == "psycopg"


def test_no_postgres_driver_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "psycopg2", "psycopg")
    with pytest.raises(MissingExtraError) as e:
        make_engine(URL)
    assert str(e.value) == ("a postgresql+psycopg2:// database URL needs 'psycopg2', which is not installed: "
                            'pip install "celery-outbox[psycopg2]"')


def test_an_explicit_driver_that_is_missing_names_its_own_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "psycopg")
    with pytest.raises(MissingExtraError, match=r'pip install "celery-outbox\[psycopg\]"$'):
        make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://h:6380/0", "sentinel://h:26379;sentinel://i:26379"])
def test_a_redis_broker_without_the_redis_client_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                                               url: str) -> None:
    hide(monkeypatch, "redis")
    with pytest.raises(MissingExtraError) as e:
        require_broker_client(url)
    assert str(e.value).endswith('needs \'redis\', which is not installed: pip install "celery-outbox[redis]"')
    assert "\n" not in str(e.value)


def test_a_rabbitmq_broker_needs_no_redis_client(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "redis")
    require_broker_client("amqp://guest:guest@127.0.0.1:5672//")
    require_broker_client("")


def test_a_redis_result_backend_still_needs_no_producer() -> None:
    # The Redis backend's class is looked up lazily now (its module imports the redis client): same answer
    from celery import Celery

    from celery_outbox.celery.enqueue import _producer_free

    assert _producer_free(Celery("t", backend="redis://127.0.0.1:6379/15", set_as_current=False).backend)
    assert not _producer_free(Celery("t", backend="rpc://", set_as_current=False).backend)
