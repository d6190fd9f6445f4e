"""The public ``Outbox`` facade: routes from declared consumers, nothing skipped silently, JSON only."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from flask import Flask
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from celery_outbox import (
    ConfigError,
    Envelope,
    Event,
    ManualClock,
    Outbox,
    Outcome,
    Settings,
    UnknownEventTypeError,
    ValidationError,
    migrate_database,
)
from celery_outbox.testing import InMemoryPublisher, drain, run_pending


class Base(DeclarativeBase):
    pass


@pytest.fixture
def engine(tmp_path: Path) -> sa.Engine:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrate_database(url)
    return sa.create_engine(url)


def make(engine: sa.Engine, **settings: object) -> Outbox:
    return Outbox(Celery("t", broker="memory://", set_as_current=False), engine=engine,
                  settings=Settings(**settings), clock=ManualClock())  # type: ignore[arg-type]


def test_declared_consumers_make_the_routes_and_their_tasks(engine: sa.Engine) -> None:
    outbox = make(engine)

    @outbox.consumer(["OrderPlaced", "OrderCancelled"], name="billing", max_retries=4)
    def billing(session: Session, event: Envelope) -> None: ...

    outbox.route("OrderPlaced", "search")  # lives in another service
    assert outbox.routes() == {"OrderCancelled": ("billing",), "OrderPlaced": ("billing", "search")}
    assert outbox.task("billing").name == "consumers.billing"
    assert outbox.app.conf.task_routes["consumers.billing"] == {"queue": "outbox.billing"}
    assert {q.name for q in outbox.app.conf.task_queues} >= {"outbox.billing", "outbox.search", "outbox.relay"}
    assert billing.policy.resolve(outbox.settings).max_deliveries == 5
    assert {"celery_outbox.drain", "celery_outbox.reconcile", "celery_outbox.prune"} <= set(outbox.app.tasks)


def test_an_event_type_nobody_consumes_is_refused_at_publish(engine: sa.Engine) -> None:
    outbox = make(engine)
    with Session(engine) as s, pytest.raises(UnknownEventTypeError, match=r"outbox.route\('Nobody'"):
        outbox.publish(s, Event("Nobody", {}))


@pytest.mark.parametrize("event", [{"type": "OrderPlaced", "payload": {}}, None, "OrderPlaced", ("OrderPlaced", {})])
def test_publishing_what_is_no_event_is_a_type_error_naming_the_verb(engine: sa.Engine, event: object) -> None:
    # Given an outbox with a consumer of OrderPlaced
    outbox = make(engine)

    @outbox.consumer("OrderPlaced", name="ledger")
    def ledger(session: Session, envelope: Envelope) -> None:
        """Records nothing."""

    # When something that is no Event is published; Then a TypeError says what publish needs, and nothing is written
    with Session(engine) as s:
        with pytest.raises(TypeError, match=r"outbox\.publish\(\) needs an Event\(type, payload\), got "):
            outbox.publish(s, event)  # type: ignore[arg-type]
        assert not s.new


@pytest.mark.parametrize(("event", "said"), [(5, "needs at least one non-empty event type"),
                                             (None, "needs at least one non-empty event type"),
                                             ([["a"]], "needs at least one non-empty event type"),
                                             ("Order\x00Placed", "at most 200 printable characters"),
                                             ("x" * 201, "at most 200 printable characters"),
                                             (["OrderPlaced", "Order\nShipped"], "at most 200 printable characters")])
def test_a_consumer_of_an_event_type_no_event_can_have_is_a_config_error(engine: sa.Engine, event: object,
                                                                         said: str) -> None:
    # Given event types no event can have (the writer refuses them) or that are no event type at all
    outbox = make(engine)
    # When a consumer declares them; Then one ConfigError line says so (was a TypeError, or accepted in silence)
    with pytest.raises(ConfigError, match=said) as e:
        outbox.consumer(event, name="ledger")  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
    # And route() judges an event type the same way
    with pytest.raises(ConfigError, match="at most 200 printable characters"):
        outbox.route("Order\x00Placed", "billing")


@pytest.mark.parametrize("type_", [5, None, "", "  ", ["OrderPlaced"]])
def test_an_event_type_that_is_no_text_is_a_validation_error_not_a_missing_route(engine: sa.Engine,
                                                                                type_: object) -> None:
    # Given an event whose type is no text (it was taken for an unrouted type: "declare @outbox.consumer(5, ...)")
    outbox = make(engine)
    # When it is published; Then the writer's own refusal says what a type must be
    with Session(engine) as s, pytest.raises(ValidationError, match="event type must be a non-empty string"):
        outbox.publish(s, Event(type_, {}))  # type: ignore[arg-type]


def test_a_settings_route_to_an_unknown_consumer_fails_at_start_up(engine: sa.Engine) -> None:
    outbox = make(engine, routes={"OrderPlaced": ("ghost",)})
    with pytest.raises(ConfigError, match=r"'ghost'.*outbox\.route"):
        outbox.check()
    # a worker runs the same check as a boot step, so it refuses to start instead of skipping the consumer
    step = next(s for s in outbox.app.steps["worker"] if s.__name__ == "OutboxCheck")
    with pytest.raises(ConfigError, match="'ghost'"):
        step(object())


def test_pickle_is_refused(engine: sa.Engine) -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.accept_content = ["json", "pickle"]
    with pytest.raises(ConfigError, match="JSON only"):
        Outbox(app, engine=engine, settings=Settings())


def test_tables_go_into_my_metadata_under_my_prefix(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    engine = sa.create_engine(url)
    outbox = make(engine, table_prefix="shop_outbox_")
    tables = outbox.define_tables(Base.metadata)
    assert {"shop_outbox_messages", "shop_outbox_inbox"} <= set(Base.metadata.tables)
    with pytest.raises(ConfigError, match="already defined"):
        outbox.define_tables(Base.metadata)
    migrate_database(url, prefix="shop_outbox_")

    @outbox.consumer("Ping", name="pong")
    def pong(session: Session, event: Envelope) -> None: ...

    with sessionmaker(engine).begin() as s:
        outbox.publish(s, Event("Ping", {"n": 1}))
    assert run_pending(outbox) == {"pong": [Outcome.PROCESSED]}
    with engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(tables.table(tables.inbox))).scalar_one() == 1
        assert "outbox_messages" not in sa.inspect(c).get_table_names()


def test_testing_helpers_run_the_pipeline_and_absorb_a_duplicate(engine: sa.Engine) -> None:
    outbox = make(engine)
    seen: list[object] = []

    @outbox.consumer("Ping", name="pong")
    def pong(session: Session, event: Envelope) -> None:
        seen.append(event.payload)

    with sessionmaker(engine).begin() as s:
        outbox.publish(s, Event("Ping", {"n": 1}))
    publisher = drain(outbox, InMemoryPublisher())
    assert len(publisher.published) == 1
    from celery_outbox.testing import deliver_message

    assert deliver_message(outbox, publisher.published[0]) is Outcome.PROCESSED
    assert deliver_message(outbox, publisher.published[0], redelivered=True) is Outcome.DUPLICATE
    assert seen == [{"n": 1}]


def test_the_flask_extension_mounts_metrics_on_any_app(engine: sa.Engine) -> None:
    from celery_outbox.contrib.flask import init_app

    web = Flask("mine")
    init_app(web, make(engine, admin_token="s3cret-token-0123456"))
    resp = web.test_client().get("/metrics")
    assert resp.status_code == 200 and b"outbox_pending" in resp.data
    assert web.test_client().get("/admin/dead-letters/").status_code == 401
    ok = web.test_client().get("/admin/dead-letters/", headers={"Authorization": "Bearer s3cret-token-0123456"})
    assert ok.status_code == 200 and b"s3cret" not in ok.data


def test_a_plain_postgresql_url_has_a_driver() -> None:
    # SQLAlchemy picks its default driver for postgresql:// (psycopg2 on 2.0, psycopg 3 on 2.1): [postgres] ships both
    engine = sa.create_engine("postgresql://nobody@127.0.0.1:1/none")
    assert engine.dialect.driver in ("psycopg2", "psycopg")


def test_a_plain_app_gets_the_relay_schedule_and_the_broker_options_it_relies_on(engine: sa.Engine) -> None:
    # Given an application's own Celery app with one beat entry and one Redis option of its own
    app = Celery("mine", broker="redis://127.0.0.1:6379/9", set_as_current=False)
    app.conf.beat_schedule = {"mine": {"task": "mine.tick", "schedule": 5.0}}
    app.conf.broker_transport_options = {"visibility_timeout": 200}
    # When the outbox is built on it
    outbox = Outbox(app, engine=engine, settings=Settings())
    # Then `celery beat` on this app drains, reconciles and prunes, beside the app's own entry
    tasks = {e["task"] for e in outbox.app.conf.beat_schedule.values()}
    assert {"mine.tick", "celery_outbox.drain", "celery_outbox.reconcile", "celery_outbox.prune"} <= tasks
    # And a killed worker's message is restored on time (the app's own timeout kept, our restore cadence added)
    options = outbox.app.conf.broker_transport_options
    assert options["visibility_timeout"] == 200 and options["unacked_restore_throttle"] == 1


def test_the_flask_extension_keeps_out_of_the_host_apps_way(engine: sa.Engine) -> None:
    from celery_outbox.contrib.flask import init_app

    # Given a host app with its own view named `metrics`
    web = Flask("host")
    web.add_url_rule("/stats", endpoint="metrics", view_func=lambda: "mine")
    # When the extension is mounted (without its /metrics path), it does not collide
    init_app(web, make(engine), metrics_path=None)
    assert web.test_client().get("/stats").data == b"mine"
    assert web.test_client().get("/metrics").status_code == 404
    # And a second mount says so clearly
    with pytest.raises(ConfigError, match="already called"):
        init_app(web, make(engine))


def test_own_migrations_tables_and_a_scoped_session_are_understood(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from sqlalchemy.orm import scoped_session

    from celery_outbox.cli import cli

    # Given the library's tables created by the application's own metadata (its Alembic / create_all)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'own.db'}")
    md = sa.MetaData()
    box = Outbox(Celery("t", broker="memory://", set_as_current=False),
                 session_factory=scoped_session(sessionmaker(engine)), settings=Settings())  # type: ignore[arg-type]
    box.define_tables(md)
    md.create_all(engine)
    # When `outbox db check` runs, it says what is missing and how to fix it, in one line
    result = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert result.exit_code == 1 and "outbox_schema_version is missing" in result.output
    # And after `outbox db upgrade` (idempotent over the existing tables) the check passes
    assert CliRunner().invoke(cli, ["db", "upgrade"], obj={"outbox": box}).exit_code == 0
    check = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert check.exit_code == 0, check.output
