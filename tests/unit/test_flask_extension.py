"""The Flask extension in the usual shape: ``FlaskOutbox()`` at import, ``init_app(app, db=db)`` in an app
factory; settings from ``app.config`` (> environment > defaults), Flask-SQLAlchemy's engine (no second pool),
``flask outbox ...``, ``/readyz`` and ``/metrics`` in one call."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from celery_outbox import ConfigError, Envelope, Event, Outcome, migrate_database
from celery_outbox.contrib.flask import EXT_OUTBOX, FlaskOutbox
from celery_outbox.testing import run_pending

TOKEN = "flask-admin-token-0123456789"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "ext_orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)


# What the team's package holds at import: the db, the extension, a consumer.
db = SQLAlchemy(model_class=Base)
ext = FlaskOutbox()
ext.define_tables(Base.metadata)
notified: list[str] = []


@ext.consumer("OrderPlaced", name="notify")
def notify(session: Session, event: Envelope) -> None:
    notified.append(event.payload["id"])


def create_app(url: str, **config: Any) -> Flask:
    """The team's app factory."""
    app = Flask(f"shop{uuid.uuid4().hex[:6]}")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, CELERY={"broker_url": "memory://localhost/"}, **config)
    db.init_app(app)
    celery = ext.init_app(app, db=db).app

    @celery.task(name="shop.confirm", shared=False)  # type: ignore[untyped-decorator]
    def confirm(order_id: str) -> None:
        notified.append(f"confirm:{order_id}")

    @app.post("/orders")
    def place() -> Any:
        with ext.transaction(db.session):   # the order, its event and its task: one commit
            db.session.add(Order(id=request.json["id"]))
            ext.publish(db.session, Event("OrderPlaced", {"id": request.json["id"]}))
            confirm.delay(request.json["id"])
            db.session.commit()
        return jsonify(ok=True), 201

    return app


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'shop.db'}"


@pytest.fixture(autouse=True)
def _clean() -> None:
    notified.clear()


def test_two_apps_from_one_factory_each_get_their_outbox_on_flask_sqlalchemys_engine(url: str) -> None:
    # When the factory runs twice (tests do), Then each app has its own Outbox on its own Celery app
    first, second = create_app(url), create_app(url)
    a, b = first.extensions[EXT_OUTBOX], second.extensions[EXT_OUTBOX]
    assert a is not b and a.app is not b.app and first.extensions["celery"] is a.app
    # And each outbox uses Flask-SQLAlchemy's engine: one pool, not a second one
    with first.app_context():
        assert a.sessions().kw["bind"] is db.engine
    # And the extension's methods act on the current app's outbox
    with second.app_context():
        assert ext.outbox is b
    # And the recommended Celery configuration is merged in (late acks for the app's own tasks)
    assert a.app.conf.task_acks_late is True and a.app.conf.task_reject_on_worker_lost is True


def test_app_config_beats_the_environment_which_beats_the_defaults(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_NAMESPACE", "from-env")
    monkeypatch.setenv("OUTBOX_ADMIN_TOKEN", TOKEN)
    app = create_app(url, OUTBOX_NAMESPACE="from-config", OUTBOX_RELAY_BATCH_SIZE="50", OUTBOX_RELAY_MAX_ATTEMPTS=4)
    s = app.extensions[EXT_OUTBOX].settings
    assert (s.namespace, s.relay_batch_size, s.relay_max_attempts, s.admin_token) == ("from-config", 50, 4, TOKEN)
    assert s.relay_poll_interval_s == 1.0
    # and the operator's token opens the dead-letter page
    migrate_database(url)
    client = app.test_client()
    assert client.get("/admin/dead-letters/").status_code == 401
    assert client.get("/admin/dead-letters/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_a_bad_or_unknown_outbox_key_in_app_config_is_one_clear_error(url: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_NAMESPAEC, which names no outbox setting"):
        create_app(url, OUTBOX_NAMESPAEC="typo")
    with pytest.raises(ConfigError, match=r"^OUTBOX_RELAY_BATCH_SIZE must be int"):
        create_app(url, OUTBOX_RELAY_BATCH_SIZE="many")


def test_flask_outbox_cli_readyz_metrics_and_a_view_end_to_end(url: str) -> None:
    app = create_app(url)
    with app.app_context():
        Order.__table__.create(db.engine)  # type: ignore[attr-defined]  # the team's own table (its migration)
    runner = app.test_cli_runner()
    # Given the library's tables created by `flask outbox db upgrade` (the outbox command's commands)
    up = runner.invoke(args=["outbox", "db", "upgrade"])
    assert up.exit_code == 0, up.output
    check = runner.invoke(args=["outbox", "db", "check"])
    assert check.exit_code == 0 and "schema ok" in check.output
    # Then /metrics and /readyz are mounted (readiness answers with its checks, whatever the broker says)
    client = app.test_client()
    assert client.get("/metrics").status_code == 200 and b"outbox_pending" in client.get("/metrics").data
    assert client.get("/readyz").status_code in (200, 503) and "checks" in client.get("/readyz").get_json()
    # When an order is placed through the view, Then the order, its event and its task are one commit
    assert client.post("/orders", json={"id": "o-1"}).status_code == 201
    stats = runner.invoke(args=["outbox", "stats", "--json"])
    assert stats.exit_code == 0 and json.loads(stats.output)["outbox"]["pending"] == 2
    # And the relay and workers, run in the test, deliver the event and run the task once
    assert run_pending(app.extensions[EXT_OUTBOX]) == {"notify": [Outcome.PROCESSED], "shop.confirm": [Outcome.PROCESSED]}
    assert sorted(notified) == ["confirm:o-1", "o-1"]


def test_init_app_twice_on_one_app_and_a_prefix_mismatch_are_refused(url: str) -> None:
    app = create_app(url)
    with pytest.raises(ConfigError, match="already called"):
        ext.init_app(app, db=db)
    with pytest.raises(ConfigError, match="OUTBOX_TABLE_PREFIX is 'shop_'"):
        create_app(url, OUTBOX_TABLE_PREFIX="shop_")
    # a Celery app given explicitly is used as it is
    other = Flask("other")
    other.config.update(SQLALCHEMY_DATABASE_URI=url)
    celery = Celery("given", broker="memory://", set_as_current=False)
    db.init_app(other)
    assert FlaskOutbox(celery=celery).init_app(other, db=db).app is celery
