"""A pooled connection is pinged at checkout only after sitting idle longer than
``Settings.db_pre_ping_idle_ms`` (celery_outbox/db.py, ``pre_ping_after_idle``); a connection that died
unpinged costs a first delivery one more run on a new connection, never a count
(celery_outbox/delivery.py). Real Postgres: its backends are terminated with ``pg_terminate_backend``,
which is what a restarted server or a proxy's cut does to a pooled connection."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import Settings, make_engine
from celery_outbox.clock import ManualClock
from celery_outbox.consumer import consumer
from celery_outbox.db import is_disconnect, make_session_factory
from celery_outbox.delivery import deliver
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from consumers.models import Shipment
from consumers.shipping import shipping
from consumers.testing import order_placed_envelope

pytestmark = [pytest.mark.postgres]
HOUR_MS = 3_600_000


class Pings:
    """Counts the pings of an engine's dialect."""

    def __init__(self, engine: sa.Engine) -> None:
        self.count = 0
        ping = engine.dialect.do_ping

        def do_ping(dbapi_connection: Any) -> bool:
            self.count += 1
            return bool(ping(dbapi_connection))

        engine.dialect.do_ping = do_ping  # type: ignore[method-assign]


def _engine(pg_url: str, idle_ms: int) -> sa.Engine:
    return make_engine(pg_url, settings=Settings(db_pre_ping_idle_ms=idle_ms), pool_size=1, max_overflow=0)


@pytest.fixture
def admin(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(pg_url, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


def _backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def _terminate(admin: sa.Engine, pid: int) -> None:
    with admin.connect() as c:
        assert c.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one() is True
        # the backend is gone once the server no longer lists it (a wait, not a timing check)
        for _ in range(100):
            if not c.exec_driver_sql(f"SELECT 1 FROM pg_stat_activity WHERE pid = {pid}").first():
                return
            time.sleep(0.05)
    pytest.fail(f"backend {pid} still listed after pg_terminate_backend")


def test_a_connection_back_in_use_within_the_window_is_not_pinged(pg_url: str) -> None:
    # Given an engine whose window is an hour
    engine = _engine(pg_url, HOUR_MS)
    pings = Pings(engine)
    try:
        # When its one pooled connection is checked out again and again (deliveries at saturation)
        pids = {_backend_pid(engine) for _ in range(20)}
        # Then it is the same connection every time and it was never pinged
        assert len(pids) == 1
        assert pings.count == 0
        assert not engine.pool._pre_ping
    finally:
        engine.dispose()


def test_zero_pings_on_every_checkout_as_sqlalchemy_does(pg_url: str) -> None:
    engine = _engine(pg_url, 0)
    pings = Pings(engine)
    try:
        for _ in range(3):
            _backend_pid(engine)
        assert engine.pool._pre_ping
        assert pings.count == 2  # a new connection is never pinged
    finally:
        engine.dispose()


def test_a_connection_that_died_idle_past_the_window_is_replaced_at_checkout(pg_url: str, admin: sa.Engine) -> None:
    # Given an engine with a 1 ms window whose pooled connection was killed while idle (a server restart)
    engine = _engine(pg_url, 1)
    pings = Pings(engine)
    try:
        dead = _backend_pid(engine)
        _terminate(admin, dead)
        # When it is checked out again, idle longer than the window
        time.sleep(0.01)
        # Then the checkout pings it, finds it dead and hands out a new connection: no error reaches the caller
        assert _backend_pid(engine) != dead
        assert pings.count == 1
    finally:
        engine.dispose()


def _delivery(engine: sa.Engine, spec: Any, env: Envelope, tables: Tables) -> Any:
    return deliver(make_session_factory(engine), spec, json.dumps(env.to_dict()), tables=tables, request_id=None,
                   settings=Settings(), clock=ManualClock(), first_delivery=True)


def _attempts(admin: sa.Engine, tables: Tables) -> list[Any]:
    with Session(admin) as s:
        return list(s.execute(sa.select(tables.attempts.message_id, tables.attempts.deliveries)).all())


def test_a_first_delivery_on_a_connection_that_died_unpinged_runs_once_more_uncounted(
        pg_url: str, admin: sa.Engine, tables: Tables) -> None:
    # Given a worker's engine that does not ping (the connection was used within the window) and whose
    # pooled connection the server dropped since its last use
    engine = _engine(pg_url, HOUR_MS)
    try:
        _terminate(admin, _backend_pid(engine))
        env = order_placed_envelope(f"o-{uuid.uuid4().hex[:8]}")
        # When a first delivery arrives
        result = _delivery(engine, shipping, env, tables)
        # Then it is processed on a new connection, once, and nothing was counted against the message
        assert (result.outcome, result.deliveries) == (Outcome.PROCESSED, 1), result
        with Session(admin) as s:
            assert s.execute(sa.select(sa.func.count()).select_from(Shipment)
                             .where(Shipment.order_id == env.payload["order_id"])).scalar_one() == 1
        assert _attempts(admin, tables) == []
    finally:
        engine.dispose()


def test_a_message_that_breaks_its_connection_every_time_is_still_counted(
        pg_url: str, tables: Tables) -> None:
    # Given a consumer whose effect loses its connection on every run (its backend dies under it)
    runs: list[int] = []

    @consumer(name="breaker", event="OrderPlaced")
    def breaker(session: Session, envelope: Envelope) -> None:
        runs.append(1)
        session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))

    engine = _engine(pg_url, HOUR_MS)
    try:
        env = order_placed_envelope("o-breaks")
        # When it is delivered
        result = _delivery(engine, breaker, env, tables)
        # Then it ran twice (once more on a new connection), and the second loss counts as a failed delivery
        assert len(runs) == 2
        assert (result.outcome, result.deliveries) == (Outcome.RETRY, 1), result
        assert result.retry_in_s is not None
        with Session(engine) as s:
            rows = s.execute(sa.select(tables.attempts.deliveries)).scalars().all()
        assert rows == [1]
    finally:
        engine.dispose()


def test_is_disconnect_follows_the_chain_of_causes(pg_url: str, admin: sa.Engine) -> None:
    engine = _engine(pg_url, HOUR_MS)
    try:
        _terminate(admin, _backend_pid(engine))
        with pytest.raises(sa.exc.DBAPIError) as raised, engine.connect() as c:
            c.exec_driver_sql("SELECT 1")
        assert is_disconnect(raised.value)
        try:
            raise RuntimeError("wrapped") from raised.value
        except RuntimeError as wrapped:
            assert is_disconnect(wrapped)
        assert not is_disconnect(ValueError("x"))
    finally:
        engine.dispose()


def test_a_task_receipt_on_a_connection_that_died_unpinged_is_written(
        pg_url: str, admin: sa.Engine, tables: Tables) -> None:
    from types import SimpleNamespace

    from celery_outbox.celery.receipts import Receipts

    # Given a worker's engine whose pooled connection the server dropped since its last use
    engine = _engine(pg_url, HOUR_MS)
    try:
        _terminate(admin, _backend_pid(engine))
        factory = make_session_factory(engine)
        ctx = SimpleNamespace(sessions=lambda: factory, clock=ManualClock(), tables=tables)
        task_id = uuid.uuid4()
        # When a plain outbox task's receipt is recorded
        # Then it is written on a new connection (else the reconciler would send the task again)
        assert Receipts(ctx).record(str(task_id)) is True
        with Session(admin) as s:
            assert s.execute(sa.select(tables.receipts.task_id)).scalars().all() == [task_id]
    finally:
        engine.dispose()
