"""A worker warmed before its first message (celery/warmup.py): delivery contexts built in the main
process before the pool forks, a database connection opened in each delivering process; nothing fatal."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import event
from sqlalchemy.orm import Session

from celery_outbox import delivery
from celery_outbox.celery import warmup
from celery_outbox.messages import Envelope
from celery_outbox.outbox import Outbox
from celery_outbox.settings import Settings


def outbox_of(url: str) -> Outbox:
    outbox = Outbox(Celery("t", broker_url="memory://", set_as_current=False), settings=Settings(database_url=url))

    @outbox.consumer("OrderPlaced", name="shipping")
    def ship(session: Session, envelope: Envelope) -> None: ...

    @outbox.consumer("OrderPlaced", name="search", batch_size=10)
    def index(session: Session, envelopes: list[Envelope]) -> None: ...

    @outbox.task(name="send_mail")
    def send_mail(session: Session, to: str) -> None: ...

    return outbox


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The consumer names whose delivery context is built, in order."""
    seen: list[str] = []
    real = delivery.DeliveryContext.build

    def counting(spec: Any, **kwargs: Any) -> delivery.DeliveryContext:
        seen.append(spec.name)
        return real(spec, **kwargs)

    monkeypatch.setattr(delivery.DeliveryContext, "build", counting)
    return seen


def test_every_consumer_and_idempotent_task_has_its_context_built_before_its_first_message(builds: list[str]) -> None:
    """Given an outbox with a consumer, a batch consumer and an idempotent task
    When the worker is warmed
    Then each delivery context is built once (a batch consumer has two: its batches' and a message run
    alone's), and the first message finds it built"""
    outbox = outbox_of("sqlite://")
    warmup.warm_process(outbox)
    assert sorted(builds) == ["search", "search", "shipping", "task:send_mail"]
    search = outbox.task("search")
    for source in (outbox.task("shipping").outbox_context, search.outbox_context, search.outbox_batch_runner.context,
                   outbox.app.tasks["send_mail"].outbox_context):
        assert isinstance(source(), delivery.DeliveryContext)
    assert len(builds) == 4


def test_a_warmup_that_fails_is_logged_masked_and_the_worker_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Given a context that cannot be built (its error names a database URL with a password)
    When the worker is warmed
    Then nothing is raised, one warning says the first message will do it, and the password is not in it"""
    outbox = outbox_of("sqlite://")

    def broken(spec: Any, **kwargs: Any) -> delivery.DeliveryContext:
        raise RuntimeError("cannot reach postgresql://app:s3cret-pw@db.internal/shop")

    monkeypatch.setattr(delivery.DeliveryContext, "build", broken)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        warmup.warm_process(outbox)
    (record,) = caplog.records
    assert "the first message does it" in record.getMessage()
    assert "s3cret-pw" not in record.getMessage() and "db.internal" in record.getMessage()


def test_a_process_opens_one_database_connection_and_returns_it_to_its_pool(tmp_path: Path) -> None:
    """Given a delivering process with no database connection yet
    When it is warmed
    Then it has opened one connection, which waits in its pool for the first message"""
    outbox = outbox_of(f"sqlite:///{tmp_path / 'app.db'}")
    engine = outbox.sessions().kw["bind"]
    connects: list[object] = []
    event.listen(engine, "connect", lambda dbapi, record: connects.append(dbapi))
    warmup.open_connection_in_background(outbox).join(timeout=30)
    assert len(connects) == 1
    assert engine.pool.checkedout() == 0 and engine.pool.checkedin() == 1
    engine.dispose()


def test_a_database_that_is_away_is_logged_once_without_its_password(caplog: pytest.LogCaptureFixture) -> None:
    """Given a database nobody listens for
    When a process is warmed
    Then nothing is raised, one line says the first message opens the connection, without the password"""
    outbox = outbox_of("postgresql+psycopg2://app:s3cret-pw@127.0.0.1:1/shop")
    with caplog.at_level(logging.INFO, logger=warmup.__name__):
        warmup.open_connection(outbox)
    (record,) = caplog.records
    assert "the first message opens it" in record.getMessage()
    assert "s3cret-pw" not in record.getMessage()


def test_the_worker_of_an_outbox_app_runs_the_warmup_step() -> None:
    outbox = outbox_of("sqlite://")
    assert any(getattr(step, "__name__", "") == "OutboxWarmup" for step in outbox.app.steps["worker"])
