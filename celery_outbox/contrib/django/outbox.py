"""``DjangoOutbox``: the project's ``Outbox`` on Django's own settings and database connection.

    # proj/celery.py
    app = Celery("proj")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    outbox = DjangoOutbox(app)          # settings.py's OUTBOX / OUTBOX_*; DATABASES["default"]

No engine to configure: the relay, the consumers' bookkeeping, ``@outbox.task`` and the CLI open their
SQLAlchemy connections to the database Django's connection ``using`` points at *when they connect*
(``DjangoSessionSource``), so under Django's test runner or pytest-django they write the test database,
never the developer's. The pool follows ``CONN_MAX_AGE``: 0 (Django's default, a connection per request)
means no pool, each session connects and closes; a positive value or None keeps connections that long.
While a Django test environment is set up there is never a pool, so no idle connection of ours stops
Django from dropping the test database at the end of the run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from celery import Celery
from sqlalchemy import Engine, pool
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.cancel import Cancelled
from celery_outbox.clock import Clock
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.db import SessionSource, make_engine, make_session_factory
from celery_outbox.errors import ConfigError, TransactionRequiredError
from celery_outbox.outbox import Outbox
from celery_outbox.schema import DEFAULT_PREFIX
from celery_outbox.settings import Settings, broker_relation_problems
from celery_outbox.writer import Event


def in_test_environment() -> bool:
    """True between Django's ``setup_test_environment()`` and its teardown (the test runner, pytest-django):
    that is when Django gives ``django.core.mail`` its ``outbox`` list (Django's testing docs, "Email services")."""
    from django.core import mail

    return hasattr(mail, "outbox")


WORKER_DEFAULTS: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
}
"""The Celery settings ``DjangoOutbox`` sets on its app unless the project set them (``celery_config`` has the
same values for the Flask path)."""


class DjangoSessionSource(SessionSource):
    """Sessions on the database of Django's connection ``using``, re-read at every call: a changed database
    (the test runner swapped in the test database, or put the real one back) gets a new engine, and the old
    engine's connections are closed."""

    def __init__(self, *, using: str, settings: Settings) -> None:  # no super(): there is no fixed URL
        self.using = using
        self._settings = settings
        self._lock = threading.Lock()
        self._key: tuple[int, str, bool, float] | None = None
        self._factory: sessionmaker[Session] | None = None

    @property
    def url(self) -> str:
        """The database URL with its password (the relay's SQLite lock file, ``outbox db``; never printed)."""
        from celery_outbox.contrib.django.conf import connection_url

        return connection_url(self.using)

    def _pooling(self) -> tuple[bool, float]:
        """(pooled, recycle seconds) from the connection's ``CONN_MAX_AGE``; never pooled under tests."""
        from django.db import connections

        age = connections[self.using].settings_dict.get("CONN_MAX_AGE", 0)
        if age == 0 or in_test_environment():
            return False, -1
        return True, -1 if age is None else float(age)

    def __call__(self) -> sessionmaker[Session]:
        url = self.url
        pooled, recycle = self._pooling()
        key = (os.getpid(), url, pooled, recycle)
        with self._lock:
            if self._factory is None or self._key != key:
                old = self._factory.kw.get("bind") if self._factory is not None else None
                if isinstance(old, Engine):
                    # another process's pool: forget it without touching its sockets; ours: close it
                    old.dispose(close=self._key is not None and self._key[0] == key[0])
                options: dict[str, Any] = {"pool_recycle": recycle} if pooled else {"poolclass": pool.NullPool}
                self._factory = make_session_factory(make_engine(url, settings=self._settings, **options))
                self._key = key
            return self._factory

    def dispose(self) -> None:
        """Close the pooled connections (none without a pool)."""
        with self._lock:
            bind = self._factory.kw.get("bind") if self._factory is not None else None
            if isinstance(bind, Engine):
                bind.dispose()


class DjangoOutbox(Outbox):
    """An ``Outbox`` configured by Django: ``Settings`` from settings.py (``outbox_settings()``, or
    ``settings=`` given), the database of ``DATABASES[using]`` through ``DjangoSessionSource``, and the
    enqueue of ``.delay()`` in ``atomic()`` on that same alias. It also becomes Celery's default app in
    this process (``@shared_task`` uses it in every thread) and the Outbox the admin acts through.

    Building it never raises for a bad ``OUTBOX_*`` value in settings.py: every ``manage.py`` command must
    start, so ``manage.py check`` can report the value (``celery_outbox.E001``: the setting, the value, what
    is allowed). The outbox is built on the default settings meanwhile, and its first use (publish,
    ``.delay()``, cancel, the relay, a worker's boot, ``manage.py outbox``) raises that same message
    (``Outbox.require_settings``)."""

    def __init__(self, app: Celery, *, using: str | None = None, settings: Settings | None = None,
                 clock: Clock | None = None) -> None:
        from django.db import DEFAULT_DB_ALIAS

        from celery_outbox.contrib.django import dead_letters, task_runner
        from celery_outbox.contrib.django.conf import outbox_settings
        from celery_outbox.contrib.django.enqueue import django_outbox_writer

        refused: ConfigError | None = None
        if settings is not None:
            resolved = settings
        else:
            try:
                resolved = outbox_settings()
                problems = broker_relation_problems(resolved, str(app.conf.broker_url or ""))
                if problems:
                    raise ConfigError("; ".join(problems))
            except ConfigError as e:  # reported by `manage.py check` (E001), raised at first use (require_settings)
                refused, resolved = e, Settings()
        self.using = using or DEFAULT_DB_ALIAS
        self._django_sessions = DjangoSessionSource(using=self.using, settings=resolved)
        # Outbox wants an engine, a factory or a URL; an unbound factory stands in until the line after,
        # and nothing opens a session in between.
        super().__init__(app, session_factory=sessionmaker(), settings=resolved, clock=clock, ambient=django_outbox_writer)
        self.sessions = self._django_sessions
        self.settings_error = refused
        app.set_default()
        self._on_commit_methods()
        self._worker_defaults()
        task_runner.define(self)  # Django Tasks (django.tasks) sent through OutboxTaskBackend run here
        if resolved.table_prefix == DEFAULT_PREFIX:  # the admin lists the default-prefix tables only
            dead_letters.use(self)

    def routes(self) -> Mapping[str, tuple[str, ...]]:
        """``Outbox.routes`` once Django has loaded its apps (``django_loaded``)."""
        django_loaded()
        return super().routes()

    def known_consumers(self) -> tuple[str, ...]:
        """``Outbox.known_consumers`` once Django has loaded its apps (``django_loaded``)."""
        django_loaded()
        return super().known_consumers()

    @property
    def schema_command(self) -> str:
        """``python manage.py migrate`` when the project installs the app ``celery_outbox.contrib.django``: its
        migrations create and upgrade the tables, and tables ``outbox db upgrade`` made first would make
        ``migrate`` fail on a table that already exists (docs/django.md). Else the library's own migrations."""
        from django.apps import apps

        django_loaded()
        if apps.is_installed("celery_outbox.contrib.django"):
            return "python manage.py migrate"
        return super().schema_command

    def include(self, spec: ConsumerSpec) -> ConsumerSpec:
        """``Outbox.include``; a Django consumer declared without ``using=`` runs on this outbox's database.
        One naming another database is refused: its inbox row and effect would commit on one database and
        its delivery counts and dead letters on another."""
        from celery_outbox.contrib.django.consumer import DjangoConsumerSpec

        if isinstance(spec, DjangoConsumerSpec):
            if spec.using is None:
                spec = dataclasses.replace(spec, using=self.using)
            elif spec.using != self.using:
                raise ConfigError(f"consumer {spec.name!r} uses Django database {spec.using!r}, this outbox "
                                  f"{self.using!r}: declare it with using={self.using!r}, or leave using out")
        return super().include(spec)

    # -- the verbs on Django's connection (an SQLAlchemy session still works as on Outbox) ------------
    def _alias(self, using: str | None, verb: str) -> str:
        """``using`` when it is this outbox's database (or omitted): the relay of this outbox reads that one
        only, so a row on another alias would never be sent. Every Django-side verb passes here, so refused
        settings raise first (``require_settings``)."""
        self.require_settings()
        if using is not None and using != self.using:
            raise ConfigError(f"outbox.{verb}(using={using!r}): this DjangoOutbox is on database {self.using!r}, "
                              f"whose relay would never see the row; leave using out, or build "
                              f"DjangoOutbox(app, using={using!r})")
        return self.using

    def consumer(self, event: str | Iterable[str], *, name: str, using: str | None = None,
                 **options: Any) -> Callable[[Any], ConsumerSpec]:
        """``@outbox.consumer(event, name=...)`` on Django: ``handler(envelope)`` writes with the ORM, and its
        writes and the inbox row commit in one ``atomic()`` on this outbox's database
        (``idempotent_consumer``, then ``include``). Options as on ``idempotent_consumer``."""
        from celery_outbox.contrib.django.consumer import idempotent_consumer

        make = idempotent_consumer(event, name=name, using=using, **options)

        def decorate(handler: Callable[[Any], object]) -> ConsumerSpec:
            return self.include(make(handler))

        return decorate

    def publish(self, session: Any, event: Event | None = None, *, using: str | None = None) -> Any:
        """``outbox.publish(event)``: the event as a row of the ``atomic()`` open on this outbox's database
        (``TransactionRequiredError`` outside one); returns the ``OutboxMessage``. ``outbox.publish(session,
        event)`` with an SQLAlchemy session is ``Outbox.publish``."""
        if event is None and isinstance(session, Event):
            from celery_outbox.contrib.django.writer import publish

            return publish(session, using=self._alias(using, "publish"), clock=self.clock,
                           max_message_bytes=self.settings.max_message_bytes,
                           known_types=self._checked_routes(session.type))
        if event is None:
            raise TypeError("outbox.publish(event) inside transaction.atomic(), or outbox.publish(session, event)")
        return super().publish(session, event)

    def cancel(self, session: Any, task_id: str | uuid.UUID | None = None, *, using: str | None = None) -> Cancelled:
        """``outbox.cancel(task_id)``: delete the pending row inside the ``atomic()`` open on this outbox's
        database (``celery_outbox.contrib.django.cancel``). ``outbox.cancel(session, task_id)`` with an
        SQLAlchemy session is ``Outbox.cancel``."""
        if task_id is None:
            from celery_outbox.contrib.django.cancel import cancel

            return cancel(session, using=self._alias(using, "cancel"))
        return super().cancel(session, task_id)

    @contextmanager
    def transaction(self, session: Any = None, *, using: str | None = None) -> Iterator[Any]:
        """``with outbox.transaction():`` is ``transaction.atomic()`` on this outbox's database: what it writes,
        ``.delay()`` and ``publish`` included, commits at its end or not at all. With an SQLAlchemy session,
        ``Outbox.transaction``."""
        if session is None:
            from django.db import transaction

            with transaction.atomic(using=self._alias(using, "transaction")):
                yield None
            return
        with super().transaction(session) as bound:
            yield bound

    def enqueue(self, session: Any, signature: Any = None, *, using: str | None = None, dedup_key: str | None = None,
                on_conflict: str = "keep", **options: Any) -> Any:
        """``outbox.enqueue(signature, dedup_key=...)``: ``Outbox.enqueue``'s rows in the ``atomic()`` open on this
        outbox's database (``TransactionRequiredError`` outside one). With an SQLAlchemy session first,
        ``Outbox.enqueue``."""
        if signature is not None:
            return super().enqueue(session, signature, dedup_key=dedup_key, on_conflict=on_conflict, **options)
        from django.db import transaction

        alias = self._alias(using, "enqueue")
        if not transaction.get_connection(alias).in_atomic_block:
            raise TransactionRequiredError(
                f"outbox.enqueue(signature) must be called inside transaction.atomic() on database {alias!r}: its "
                "rows commit or roll back with the work that decided them; nothing was sent")
        return self._enqueue(nullcontext, session, dedup_key=dedup_key,
                             on_conflict=on_conflict, options=options)

    def _worker_defaults(self) -> None:
        """What ``recommended_celery_config`` gives the Flask path, for the app's OWN tasks too: late acks and
        ``reject_on_worker_lost`` (a task whose worker is SIGKILLed is redelivered, not lost), prefetch 1; task
        events stay Celery's default (off; Flower turns them on). Only keys the project did not set
        (``CELERY_*`` in settings.py or on ``app.conf``); its own choice wins. The keys are ``WORKER_DEFAULTS``."""
        conf = self.app.conf
        prefix = conf.__dict__.get("prefix") or ""
        for key, value in WORKER_DEFAULTS.items():
            names = {key, key.upper(), f"{prefix}{key.upper()}"}
            if not any(name in source for source in conf.maps[:-1] for name in names):  # the last map: Celery's defaults
                conf[key] = value

    def _on_commit_methods(self) -> None:
        """``delay_on_commit``/``apply_async_on_commit`` on this app's tasks (Celery's ``DjangoTask`` API, given
        to every task of the app): inside ``atomic()`` on the outbox's alias a task the outbox carries is a row
        of THAT transaction, written now (no window between the commit and a callback where a crash loses
        it); a task the outbox does not carry keeps Django's ``on_commit``; outside ``atomic()`` it is sent at
        once, as ``on_commit`` would (then ``enqueue_outside_transaction`` decides)."""
        outbox = self

        def apply_async_on_commit(task: Any, *args: Any, **kwargs: Any) -> Any:
            from django.db import transaction

            in_atomic = transaction.get_connection(outbox.using).in_atomic_block
            if not in_atomic or outbox._enqueue_interceptor.captures(task.name, {}):
                return task.apply_async(*args, **kwargs)
            transaction.on_commit(functools.partial(task.apply_async, *args, **kwargs), using=outbox.using)
            return None

        def delay_on_commit(task: Any, *args: Any, **kwargs: Any) -> Any:
            return apply_async_on_commit(task, args, kwargs)

        base = self.app.Task
        base.apply_async_on_commit = apply_async_on_commit
        base.delay_on_commit = delay_on_commit


def django_loaded() -> None:
    """Start Django in a process that imported ``proj/celery.py`` without starting it (``outbox -A proj.celery
    relay``): the consumers a project includes in ``AppConfig.ready()`` exist only once Django has loaded its
    apps, and a relay reading the routes before would dead-letter every event as unrouted. A no-op once
    the apps are loaded, and while Django is loading them (a ``ready()`` including a consumer)."""
    from django.apps import apps

    if apps.ready or apps.loading:
        return
    import django

    django.setup()


def project_outbox() -> Outbox:
    """The project's ``Outbox``: the one ``DjangoOutbox(app)`` registered in this process, else the one
    ``OUTBOX_INSTANCE`` names; ``ConfigError`` naming the fixes when there is none (``manage.py outbox``, the
    ``django.tasks`` backend)."""
    from django.conf import settings

    from celery_outbox.contrib.django import dead_letters

    outbox = dead_letters.registered()
    if outbox is not None:
        return outbox
    if getattr(settings, dead_letters.SETTING, None) is None:
        raise ConfigError(
            "this process built no DjangoOutbox: import your Celery app where Django starts (proj/__init__.py: "
            f"`from .celery import app as celery_app`), set {dead_letters.SETTING} = 'proj.celery:outbox' in "
            "settings.py, or name it: manage.py outbox -A proj.celery ...")
    return dead_letters.configured()[0]
