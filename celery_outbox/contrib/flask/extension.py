"""The ``FlaskOutbox`` extension, and ``init_app(app, outbox)``, which mounts the admin pages,
``/metrics`` and ``/readyz`` on any Flask app.

The usual shape (declare at import, bind in the app factory) is in the package docstring (``__init__``).

``init_app`` builds the app's ``Outbox`` from ``app.config``'s ``OUTBOX_*`` keys (explicit arguments:
they beat the environment, which beats the defaults), on Flask-SQLAlchemy's ``db.engine`` (one pool),
on the Celery app in ``app.extensions["celery"]`` (or a new one configured from ``app.config["CELERY"]``,
as Flask's Celery guide does), merges ``recommended_celery_config`` into it, mounts ``/readyz``,
``/metrics`` and the dead-letter page, and adds ``flask outbox ...``: the ``outbox`` command's
commands, on this app's outbox.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.local import Proxy
from flask import Flask, current_app, has_app_context
from sqlalchemy.orm import Session

from celery_outbox.cancel import Cancelled
from celery_outbox.celery.config import recommended_celery_config
from celery_outbox.celery.probe import DEFAULT_TIMEOUT_S as DEFAULT_BROKER_TIMEOUT_S
from celery_outbox.celery.queue_depth import queue_probe
from celery_outbox.consumer import ConsumerSpec, consumer
from celery_outbox.contrib.flask.admin import EXT, make_blueprint
from celery_outbox.contrib.flask.cli import flask_cli
from celery_outbox.contrib.flask.probes import mount_metrics, mount_readiness
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.batch import BatchHandler
from celery_outbox.inbox.claim import Handler
from celery_outbox.ops import dead_letters as dl
from celery_outbox.ops import metrics as ops_metrics
from celery_outbox.outbox import Outbox
from celery_outbox.schema import Tables, define_tables
from celery_outbox.settings import Settings
from celery_outbox.writer import Event


def init_app(app: Flask, outbox: Outbox, *, send: dl.Sender | None = None, readiness_path: str | None = "/readyz",
             metrics_path: str | None = "/metrics", broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S) -> None:
    """Mount the dead-letter page (``/admin/dead-letters``, token from ``Settings.admin_token``),
    ``/metrics`` and the readiness probe on any Flask app (a path of None leaves that one out; the
    endpoints are named ``celery_outbox_*`` so they never collide with the app's own); ``send`` replaces
    the Celery sender for replays (tests). Once per app."""
    if EXT in app.extensions:
        raise ConfigError("celery_outbox.contrib.flask.init_app was already called on this Flask app")
    registry = ops_metrics.make_registry(tables=outbox.tables, session_factory=outbox.sessions(), clock=outbox.clock,
                                         queue_probe=queue_probe(outbox, timeout_s=broker_timeout_s))
    app.extensions[EXT] = {"send": send, "registry": registry, "outbox": outbox}
    app.register_blueprint(make_blueprint())
    if readiness_path is not None:
        mount_readiness(app, outbox, readiness_path, broker_timeout_s)
    if metrics_path is not None:
        mount_metrics(app, registry, metrics_path)


EXT_OUTBOX = "celery_outbox"  # app.extensions key of the app's Outbox


def settings_from_config(config: Mapping[str, Any]) -> Settings:
    """``app.config``'s ``OUTBOX_<FIELD>`` keys as explicit arguments: they beat the ``OUTBOX_*``
    environment, which beats the defaults. Text is read as the environment variable would be (``"50"``
    is 50); an ``OUTBOX_`` key naming no setting is refused (a typo would be ignored for ever)."""
    fields = {f"OUTBOX_{f.name.upper()}": f.name for f in dataclasses.fields(Settings)}
    ours = {k: v for k, v in config.items() if isinstance(k, str) and k.startswith("OUTBOX_")}
    unknown = sorted(k for k in ours if k not in fields)
    if unknown:
        raise ConfigError(f"app.config has {', '.join(unknown)[:200]}, which names no outbox setting "
                          f"(known: OUTBOX_NAMESPACE, OUTBOX_DATABASE_URL, ... see docs/settings.md)")
    text = {k: v for k, v in ours.items() if isinstance(v, str)}
    given = {fields[k]: v for k, v in ours.items() if not isinstance(v, str)}
    return Settings.from_env({**os.environ, **text}, **given)


class FlaskOutbox:
    """The Flask extension: ``FlaskOutbox()`` at import, ``init_app(app, db=db)`` in the app factory (package
    docstring). Each app gets its own ``Outbox`` (``app.extensions``); the methods here act on the current app's.

    The verbs are ``Outbox``'s. Declarations (``consumer``, ``task``, ``periodic``, ``route``) can be made at
    import in any module, before any ``init_app``: each is recorded and made on every app's ``Outbox`` when
    ``init_app`` builds it (at once on those already built). ``@outbox.task`` returns a proxy of the task
    (Celery's ``shared_task`` kind): ``.delay()``, ``.s()``, ``.apply()`` act on the current app's task.
    ``publish``, ``cancel``, ``transaction`` and ``enqueue`` take Flask-SQLAlchemy's ``db.session``."""

    def __init__(self, app: Flask | None = None, *, db: Any = None, celery: Celery | None = None) -> None:
        self._db = db
        self._celery = celery
        self._declared: list[Callable[[Outbox], object]] = []
        self._bound: weakref.WeakSet[Outbox] = weakref.WeakSet()  # the apps' outboxes, not kept alive here
        self._tables: Tables | None = None
        self._last: Outbox | None = None
        if app is not None:
            self.init_app(app)

    # -- at import ------------------------------------------------------------------------------
    def _declare(self, make: Callable[[Outbox], object]) -> None:
        """Record a declaration for every app's ``Outbox``; make it now on those ``init_app`` already built."""
        self._declared.append(make)
        for outbox in list(self._bound):
            make(outbox)

    def consumer(self, event: str | Iterable[str], *, name: str,
                 **options: Any) -> Callable[[Handler | BatchHandler], ConsumerSpec]:
        """``@outbox.consumer(...)`` as on ``Outbox`` (``batch_size=`` too): the consumer joins every app's outbox
        at ``init_app``."""
        make = consumer(name=name, event=event, **options)

        def decorate(handler: Handler | BatchHandler) -> ConsumerSpec:
            spec = make(handler)
            self._declare(lambda outbox: outbox.include(spec))
            return spec

        return decorate

    def route(self, event_type: str, *consumers: str) -> None:
        """``Outbox.route``: consumers that live in another service."""
        self._declare(lambda outbox: outbox.route(event_type, *consumers))

    def task(self, consumer_name: str | Callable[..., Any] | None = None, /, *, name: str | None = None,
             **options: Any) -> Any:
        """``Outbox.task``. ``@outbox.task`` / ``@outbox.task(name=..., max_retries=...)`` at import: an
        idempotent task defined on every app's Celery app at ``init_app``; the decorator returns a proxy
        that resolves to the current app's task (outside an app context, the last app's).
        ``outbox.task("billing")``: a proxy of consumer ``billing``'s task."""
        if isinstance(consumer_name, str):
            if name is not None or options:
                raise ConfigError("outbox.task('<consumer>') looks up a consumer's task; to define an idempotent "
                                  "task use @outbox.task(name=..., ...) on a function")
            looked_up = consumer_name
            return Proxy(lambda: self.outbox.task(looked_up))

        def decorate(fn: Callable[..., Any]) -> Any:
            if not callable(fn):
                raise ConfigError(f"@outbox.task decorates a function, got {type(fn).__name__}")
            task_name_ = name if name is not None else f"{fn.__module__}.{fn.__qualname__}"
            self._declare(lambda outbox: outbox.task(name=task_name_, **options)(fn))
            return Proxy(lambda: self.outbox.app.tasks[task_name_])

        return decorate if consumer_name is None else decorate(consumer_name)

    def periodic(self, name: str, task: str, schedule: Any, *, args: Any = (),
                 kwargs: Mapping[str, Any] | None = None, **options: Any) -> None:
        """``Outbox.periodic``: the beat entry goes into every app's Celery configuration at ``init_app``."""
        self._declare(lambda outbox: outbox.periodic(name, task, schedule, args=args, kwargs=kwargs, **options))

    def define_tables(self, metadata: sa.MetaData, *, prefix: str | None = None) -> Tables:
        """Put the library's tables into your ``metadata`` (``OUTBOX_TABLE_PREFIX`` of the environment, or
        ``prefix``); every app's ``OUTBOX_TABLE_PREFIX`` must then agree."""
        if self._tables is not None:
            raise ConfigError("the outbox tables are already defined; call define_tables(metadata) once")
        self._tables = define_tables(metadata, prefix=prefix if prefix is not None else Settings().table_prefix)
        return self._tables

    # -- in the app factory ---------------------------------------------------------------------
    def init_app(self, app: Flask, *, db: Any = None, celery: Celery | None = None, celery_config: bool = True,
                 readiness_path: str | None = "/readyz", metrics_path: str | None = "/metrics",
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S) -> Outbox:
        """Build this app's ``Outbox`` and mount ``/readyz``, ``/metrics``, the dead-letter page and
        ``flask outbox``; returns the ``Outbox``. ``celery_config=False`` leaves the Celery app's
        configuration as it is (else ``recommended_celery_config`` is merged into it)."""
        if EXT_OUTBOX in app.extensions:
            raise ConfigError("FlaskOutbox.init_app was already called on this Flask app")
        settings = settings_from_config(app.config)
        if self._tables is not None and self._tables.prefix != settings.table_prefix:
            raise ConfigError(f"OUTBOX_TABLE_PREFIX is {settings.table_prefix!r} but define_tables() used "
                              f"{self._tables.prefix!r}: give both the same prefix")
        celery_app = celery or self._celery or app.extensions.get("celery") or self._new_celery(app)
        if celery_config:
            celery_app.conf.update(recommended_celery_config(settings))
        database = db if db is not None else self._db
        engine: sa.Engine | None = None
        if database is not None:
            with app.app_context():
                engine = database.engine  # Flask-SQLAlchemy's engine: one pool for the app and the outbox
        outbox = Outbox(celery_app, engine=engine, settings=settings)
        if self._tables is not None:
            outbox._tables = self._tables  # the tables in the team's metadata, one mapping for every app
        for make in self._declared:
            make(outbox)
        outbox.check()
        init_app(app, outbox, readiness_path=readiness_path, metrics_path=metrics_path,
                 broker_timeout_s=broker_timeout_s)
        app.extensions[EXT_OUTBOX] = outbox
        app.cli.add_command(flask_cli(lambda: current_app.extensions[EXT_OUTBOX]), name="outbox")
        self._last = outbox
        self._bound.add(outbox)
        return outbox

    @staticmethod
    def _new_celery(app: Flask) -> Celery:
        """A Celery app for ``app`` as Flask's Celery guide makes one: configured from ``app.config["CELERY"]``,
        every task run inside ``app.app_context()`` (``db.session`` works in a task), the default app
        (``@shared_task`` binds to it), kept in ``app.extensions["celery"]``."""
        from celery import Task

        class FlaskTask(Task):
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                with app.app_context():
                    return self.run(*args, **kwargs)  # type: ignore[no-untyped-call]

        celery_app = Celery(app.import_name, task_cls=FlaskTask)
        celery_app.config_from_object(dict(app.config.get("CELERY") or {}))
        celery_app.set_default()
        app.extensions["celery"] = celery_app
        return celery_app

    # -- at run time ----------------------------------------------------------------------------
    @property
    def outbox(self) -> Outbox:
        """The current app's ``Outbox`` (outside an app context: the last one ``init_app`` built)."""
        if has_app_context() and EXT_OUTBOX in current_app.extensions:
            found: Outbox = current_app.extensions[EXT_OUTBOX]
            return found
        if self._last is None:
            raise ConfigError("FlaskOutbox.init_app(app) has not run yet")
        return self._last

    def publish(self, session: Any, event: Event) -> Any:
        """``Outbox.publish`` on the current app's outbox (``db.session`` works)."""
        return self.outbox.publish(session, event)

    def cancel(self, session: Any, task_id: str | uuid.UUID) -> Cancelled:
        """``Outbox.cancel`` on the current app's outbox (``db.session`` works)."""
        return self.outbox.cancel(session, task_id)

    @contextmanager
    def transaction(self, session: Any) -> Iterator[Session]:
        """``Outbox.transaction``: inside it ``task.delay()`` becomes a row of ``session`` (``db.session``)."""
        with self.outbox.transaction(session) as bound:
            yield bound

    def enqueue(self, session: Any, signature: Any, **options: Any) -> Any:
        """``Outbox.enqueue`` on the current app's outbox (``db.session`` works)."""
        return self.outbox.enqueue(session, signature, **options)
