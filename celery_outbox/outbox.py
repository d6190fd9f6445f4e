"""``Outbox``: the one object an application builds; it binds the library to the application's Celery app.

    app = Celery("shop")
    outbox = Outbox(app, engine=engine)
    outbox.define_tables(Base.metadata)
    @outbox.consumer("OrderPlaced", name="notify")
    def notify(session, event): ...
    with Session.begin() as s:
        s.add(order); outbox.publish(s, Event("OrderPlaced", {"order_id": order.id}))

Routes are the consumers declared here plus ``route()`` for consumers in other services; a route in
the settings (``OUTBOX_ROUTES``) may override them, but must name a known consumer (README, "Adopt it").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, overload

import sqlalchemy as sa
from celery import Celery, bootsteps, signals
from kombu import Exchange, Queue
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from celery_outbox import dedup
from celery_outbox.cancel import Cancelled
from celery_outbox.cancel import cancel as cancel_row
from celery_outbox.celery import (
    beat,
    consumer_tasks,
    delayed_retry,
    events,
    gate,
    idempotent_task,
    ops_tasks,
    receipts,
    registry_step,
    relay_tasks,
    tracing_hook,
    warmup,
)
from celery_outbox.celery import enqueue as task_capture
from celery_outbox.celery.config import (
    BrokerClientCheck,
    add_task_routes,
    beat_schedule,
    is_sentinel_url,
    queue_arguments,
    redis_transport_options,
    sentinel_options,
)
from celery_outbox.clock import Clock, SystemClock
from celery_outbox.config.declare import broker_kind
from celery_outbox.consumer import ConsumerRegistry, ConsumerSpec, check_event_type, consumer
from celery_outbox.crashpoints import CrashPoints
from celery_outbox.db import SessionSource, resolve_session
from celery_outbox.errors import ConfigError, UnknownEventTypeError, ValidationError
from celery_outbox.inbox.batch import BatchHandler
from celery_outbox.inbox.claim import Handler, Prepare
from celery_outbox.messages import task_name
from celery_outbox.names import check_name
from celery_outbox.policy import RetryPolicy
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import OutboxRow, Tables, define_tables
from celery_outbox.settings import Settings, broker_relation_problems
from celery_outbox.writer import Event, add, require_event

Ambient = Callable[["Outbox"], "task_capture.Writer | None"]
"""A framework's open transaction as a task writer for an outbox (None: no such transaction here)."""


class Outbox:
    """The outbox, inbox and consumers of one application, on its own Celery app."""

    def __init__(self, app: Celery, *, engine: sa.Engine | None = None,
                 session_factory: sessionmaker[Session] | None = None, settings: Settings | None = None,
                 clock: Clock | None = None, ambient: Ambient | None = None) -> None:
        self.app = app
        # Where a task sent with no ``outbox.transaction`` bound goes first: a framework's own open transaction
        # (``DjangoOutbox`` hands in Django's ``atomic()``: contrib/django/enqueue.py), asked by the capture.
        self.ambient = ambient
        self.settings = settings if settings is not None else Settings.from_env()
        self.settings_error: ConfigError | None = None  # DjangoOutbox: settings.py's error, raised at first use
        if engine is None and session_factory is None:
            self.sessions = SessionSource(url=self.settings.effective_database_url, settings=self.settings)
        else:
            self.sessions = SessionSource(engine=engine, session_factory=session_factory)
        self.clock: Clock = clock or SystemClock()
        self.crash_points = CrashPoints(spec=self.settings.crash_points)
        self.registry = ConsumerRegistry()
        self._tables: Tables | None = None
        self._remote: dict[str, list[str]] = {}
        self._tasks: dict[str, Any] = {}
        self._configure_app()
        relay_tasks.register(app, self)
        ops_tasks.register(app, self)
        self._install_enqueue()
        gate.register(self)  # every task message a worker of this app takes is checked (celery/gate.py)
        app.steps["consumer"].add(events.UnconfirmedTaskEvents)  # task events without confirm waits (celery/events.py)
        # quorum queues: retries wait in the broker's delay chain, not in a worker (celery/delayed_retry.py)
        app.steps["consumer"].add(delayed_retry.delayed_retries_step(
            (self.settings.exchange_name, f"{self.settings.namespace}.relay")))
        tracing_hook.install(self)  # OUTBOX_TRACER_PROVIDER: here and in each worker pool process
        app.steps["worker"].add(self._boot_check_step())
        self._broker_client = BrokerClientCheck(app)  # the signal holds it weakly: it goes with this outbox
        signals.import_modules.connect(self._broker_client, weak=True)
        app.steps["worker"].add(receipts.receipt_step(self))  # plain outbox tasks' receipts (reconciler)
        app.steps["worker"].add(registry_step.registry_step(self))  # the worker registry (deploy hold)
        app.steps["worker"].add(warmup.warmup_step(self))  # contexts and a connection before the first message

    # -- schema ----------------------------------------------------------------------------------
    def define_tables(self, metadata: sa.MetaData) -> Tables:
        """Put the library's tables into ``metadata`` (your Alembic autogenerate then sees them)."""
        if self._tables is not None:
            raise ConfigError("the outbox tables are already defined; call outbox.define_tables(metadata) once, "
                              "before the first publish or task")
        self._tables = define_tables(metadata, prefix=self.settings.table_prefix)
        return self._tables

    @property
    def tables(self) -> Tables:
        if self._tables is None:
            self._tables = define_tables(sa.MetaData(), prefix=self.settings.table_prefix)
        return self._tables

    # -- consumers and routes --------------------------------------------------------------------
    def consumer(self, event: str | Iterable[str], *, name: str, ordering: bool = False, fast_path: bool = True,
                 prepare: Prepare | None = None, max_retries: int | None = None, retry_backoff: bool | float = True,
                 retry_backoff_max: float | None = None, retry_jitter: bool = False, batch_size: int | None = None,
                 batch_wait_ms: int | None = None) -> Callable[[Handler | BatchHandler], ConsumerSpec]:
        """Declare ``handler(session, envelope)`` as consumer ``name`` of ``event``: a Celery task on its own
        queue whose effect commits with its inbox row. Retry options mean what they mean on ``@app.task``.

        ``batch_size=N`` (``batch_wait_ms=M``, 50 by default): a batch consumer, ``handler(session, envelopes)``
        called with up to N messages that arrived within M ms, their inbox rows claimed in one statement and
        committed with its effect; a failing batch is split so a poison message is dead-lettered alone
        (docs/tasks.md, "Batch consumers")."""
        make = consumer(name=name, event=event, ordering=ordering, fast_path=fast_path, prepare=prepare,
                        max_retries=max_retries, retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                        retry_jitter=retry_jitter, batch_size=batch_size, batch_wait_ms=batch_wait_ms)

        def decorate(handler: Handler | BatchHandler) -> ConsumerSpec:
            return self.include(make(handler))

        return decorate

    def include(self, spec: ConsumerSpec) -> ConsumerSpec:
        """Add a consumer built elsewhere (a package of consumers shared by several apps) as its task."""
        spec.policy.resolve(self.settings, broker_url=self._app_broker_url())  # fails here, not at delivery
        self.registry.add(spec)
        self._add_queue(spec.name)
        self._tasks[spec.name] = consumer_tasks.define(self.app, self, spec)
        return spec

    def route(self, event_type: str, *consumers: str) -> None:
        """Route ``event_type`` to consumers that live in another service (declared there)."""
        if not isinstance(event_type, str) or not event_type.strip():
            raise ConfigError("route() needs a non-empty event type")
        check_event_type(event_type, owner="route()")
        if not consumers:
            raise ConfigError(f"route({event_type!r}) names no consumer")
        names = self._remote.setdefault(event_type, [])
        for c in consumers:
            check_name(c)
            if c not in names:
                names.append(c)
                self._add_queue(c)

    def idempotent_tasks(self) -> frozenset[str]:
        """Names of the ``@outbox.task`` tasks on this app: the reconciler checks their inbox rows."""
        return frozenset(name for name, task in self.app.tasks.items() if getattr(task, "outbox_task_key", None))

    def known_consumers(self) -> tuple[str, ...]:
        names = dict.fromkeys(self.registry.names())
        for cs in self._remote.values():
            names.update(dict.fromkeys(cs))
        return tuple(names)

    def routes(self) -> Mapping[str, tuple[str, ...]]:
        """Event type -> consumers: declared, plus ``route()``, then the settings' routes on top."""
        merged: dict[str, list[str]] = {}
        for spec in self.registry:
            for ev in sorted(spec.events):
                merged.setdefault(ev, []).append(spec.name)
        for ev, cs in self._remote.items():
            have = merged.setdefault(ev, [])
            have.extend(c for c in cs if c not in have)
        out = {ev: tuple(cs) for ev, cs in merged.items()}
        known = set(self.known_consumers())
        for ev, names in self.settings.routes.items():
            unknown = [c for c in names if c not in known]
            if unknown:
                raise ConfigError(
                    f"OUTBOX_ROUTES routes {ev!r} to {', '.join(map(repr, unknown))}, which no @outbox.consumer "
                    f"declares here and no outbox.route() names: declare the consumer, or add "
                    f"outbox.route({ev!r}, {', '.join(map(repr, unknown))}) if it lives in another service")
            out[ev] = tuple(names)
        return out

    def check(self) -> None:
        """Raise ``ConfigError`` for unusable settings or a route that would skip a consumer; a worker of the
        app runs it at boot, the ``outbox`` command before any command."""
        self.require_settings()
        self.routes()

    def require_settings(self) -> None:
        """Raise the ``ConfigError`` the settings were refused with, when they were (a ``DjangoOutbox`` is built
        whatever settings.py says, so ``manage.py check`` can report it as ``celery_outbox.E001``): the first use
        of the outbox (publish, cancel, a task sent, the relay, a worker, a command) fails with that message."""
        if self.settings_error is not None:
            raise ConfigError(str(self.settings_error))

    # -- write side ------------------------------------------------------------------------------
    def publish(self, session: Session | scoped_session[Session], event: Event) -> OutboxRow:
        """Stage ``event`` in ``session``'s transaction (a ``Session`` or a ``scoped_session`` such as
        Flask-SQLAlchemy's ``db.session``); it commits or rolls back with your data."""
        self.require_settings()
        event = require_event(event)
        return add(resolve_session(session, verb="publish"), event, tables=self.tables, clock=self.clock,
                   max_message_bytes=self.settings.max_message_bytes, known_types=self._checked_routes(event.type))

    def _checked_routes(self, event_type: str) -> Mapping[str, tuple[str, ...]]:
        """``routes()``, after checking that ``event_type`` has a consumer (``UnknownEventTypeError`` if not)."""
        if not isinstance(event_type, str) or not event_type.strip():  # the writer's first rule, judged first
            raise ValidationError(f"event type must be a non-empty string, got {type(event_type).__name__}")
        routes = self.routes()
        if event_type not in routes:
            raise UnknownEventTypeError(
                f"no consumer is routed for event type {event_type!r}: declare @outbox.consumer({event_type!r}, "
                f"name=...) or call outbox.route({event_type!r}, 'consumer-name')")
        return routes

    # -- transactional enqueue (celery_outbox/celery/enqueue.py) -----------------------------------
    @contextmanager
    def transaction(self, session: Session | scoped_session[Session]) -> Iterator[Session]:
        """Inside this block, tasks sent through this outbox's Celery app (``task.delay()``,
        ``apply_async()``, ``signature.delay()``, chains and groups) become outbox rows in ``session``:
        they commit or roll back with your data, and the relay publishes them after the commit.

            with Session.begin() as s, outbox.transaction(s):
                s.add(order)
                send_confirmation.delay(order.id)     # unchanged: a row in s, sent after the commit

        Blocks nest (the innermost session wins). Binding only: committing stays the caller's job.
        """
        self.require_settings()
        bound = resolve_session(session, verb="transaction")
        capture = self._enqueue_interceptor
        with capture.bind(capture.session_writer(bound)):
            yield bound

    def enqueue(self, session: Session | scoped_session[Session], signature: Any, *, dedup_key: str | None = None,
                on_conflict: str = "keep", **options: Any) -> Any:
        """Send ``signature`` (``task.s(...)``, a chain, a group) as outbox rows in ``session``; returns
        Celery's ``AsyncResult``. The task id is the outbox message id.

        ``dedup_key``: at most one pending task with this key (a single task's signature only).
        ``on_conflict="keep"`` leaves the pending one and writes nothing, ``"replace"`` deletes it and
        writes this one; the result's id is the key's pending task either way (docs/scheduled.md)."""
        resolve_session(session, verb="enqueue")
        return self._enqueue(lambda: self.transaction(session), signature, dedup_key=dedup_key,
                             on_conflict=on_conflict, options=options)

    def _enqueue(self, bind: Callable[[], AbstractContextManager[Any]], signature: Any, *, dedup_key: str | None,
                 on_conflict: str, options: dict[str, Any]) -> Any:
        """``enqueue`` inside ``bind()``: the block whose transaction the rows join (a session's, an ``atomic()``)."""
        self.require_settings()
        if not hasattr(signature, "apply_async"):
            raise TypeError(f"outbox.enqueue() needs a Celery signature (task.s(...)), got {type(signature).__name__}")
        if dedup_key is None:
            with bind():
                return signature.apply_async(**options)
        if hasattr(signature, "tasks") or not getattr(signature, "task", None):
            raise ValidationError(f"outbox.enqueue(dedup_key=...): {dedup.ONE_TASK_ONLY}")
        headers = {**(options.pop("headers", None) or {}), dedup.KEY_HEADER: dedup_key,
                   dedup.ON_CONFLICT_HEADER: on_conflict}
        with bind(), self._enqueue_interceptor.recording_dedup() as done:
            result = signature.apply_async(headers=headers, **options)
        if len(done) != 1:  # pragma: no cover - the capture writes the one task it was given
            raise ConfigError(f"outbox.enqueue(dedup_key=...): expected one write with the key, saw {len(done)}")
        return self.app.AsyncResult(str(done[0].message_id)) if done[0].outcome == "kept" else result

    def cancel(self, session: Session | scoped_session[Session], task_id: str | uuid.UUID) -> Cancelled:
        """Cancel a task (or event) still waiting in the outbox, in ``session``'s transaction: its row is
        deleted when you commit, so it never runs, even with every worker down. A task the relay already
        published raises ``AlreadyPublishedError`` (never silently ignored); an unknown id ``NotFoundError``.
        See docs/scheduled.md."""
        self.require_settings()
        return cancel_row(resolve_session(session, verb="cancel"), task_id, tables=self.tables)

    def ambient_writer(self) -> task_capture.Writer | None:
        """The writer of the framework transaction open around a ``delay()`` (``ambient=``), or None."""
        return self.ambient(self) if self.ambient is not None else None

    def _install_enqueue(self) -> None:
        self._enqueue_interceptor = task_capture.install(self)

    # -- relay -----------------------------------------------------------------------------------
    def _app_broker_url(self) -> str:
        """The broker the settings or, when they name none, the Celery app name ('' when neither does)."""
        return str(self.settings.broker_url or self.app.conf.broker_url or "")

    @property
    def schema_command(self) -> str:
        """The command that creates and upgrades this outbox's tables, the one the CLI's hints name: the library's
        own migrations, ``outbox db upgrade`` (``DjangoOutbox``: ``python manage.py migrate`` in a project that
        installs the app ``celery_outbox.contrib.django``)."""
        return "outbox db upgrade"

    def broker_url(self) -> str:
        url = self.settings.broker_url or self.app.conf.broker_url or ""
        if not url:
            raise ConfigError("no broker: set broker_url on the Celery app or OUTBOX_BROKER_URL")
        return str(url)

    def periodic(self, name: str, task: str, schedule: Any, *, args: Any = (), kwargs: Mapping[str, Any] | None = None,
                 **options: Any) -> None:
        """Add the beat entry ``name`` whose ticks go through the outbox: in ``celery beat`` each tick is an
        outbox row whose task id is made from ``name`` and the period it falls in, so a beat restart never
        loses or doubles a tick (docs/scheduled.md, "Periodic tasks"). ``schedule``: seconds, a timedelta,
        ``celery.schedules.schedule`` or ``crontab``; ``options`` are ``apply_async`` options."""
        conf = self.app.conf
        conf.beat_schedule = {**(conf.beat_schedule or {}),
                              name: beat.entry(name, task, schedule, args=args, kwargs=kwargs, options=options)}

    def relay_loop(self, *, listen: bool = True) -> RelayLoop:
        """A standalone relay (``outbox relay`` runs one); close it and its publisher when done."""
        self.require_settings()
        return relay_tasks.relay_loop(self, listen=listen)

    @overload
    def task(self, consumer_name: str | Callable[..., Any], /) -> Any: ...

    @overload
    def task(self, consumer_name: None = None, /, *, name: str | None = None, max_retries: int | None = None,
             retry_backoff: bool | float = True, retry_backoff_max: float | None = None, retry_jitter: bool = False,
             version: int | None = None, **options: Any) -> Callable[[Callable[..., Any]], Any]: ...

    def task(self, consumer_name: str | Callable[..., Any] | None = None, /, *, name: str | None = None,
             max_retries: int | None = None, retry_backoff: bool | float = True, retry_backoff_max: float | None = None,
             retry_jitter: bool = False, version: int | None = None, **options: Any) -> Any:
        """Two uses. ``outbox.task("billing")``: the Celery task of a consumer declared here.

        As a decorator, ``@outbox.task`` or ``@outbox.task(name=..., max_retries=...)``: define an
        idempotent Celery task on this outbox's app whose function takes ``(session, *args, **kwargs)``;
        its database effect commits with the inbox row ``(task id, task key)``, so a redelivered or
        duplicated message has one effect. Retry options mean what they mean on ``@app.task`` (counted in
        the database); after them the call is dead-lettered and replayable. Other ``@app.task`` options
        (``queue``, ``rate_limit``, ...) pass through. See ``celery_outbox.celery.idempotent_task``.

        ``version=N`` (a positive integer, 1 when omitted): the message format this code accepts, up to N.
        A row enqueued by this code carries N, and the relay holds it until every live worker of its queue
        runs the task at N or later (a rolling deploy; docs/scheduled.md "Deploys"). A plain ``@app.task``
        takes the same as ``outbox_task_version=N``.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= 1_000_000):
            raise ConfigError(f"@outbox.task(version=...) must be an integer from 1 to 1000000, got {version!r}")
        if isinstance(consumer_name, str):
            if name is not None or options or max_retries is not None or version is not None:
                raise ConfigError("outbox.task('<consumer>') looks up a consumer's task; to define an idempotent "
                                  "task use @outbox.task(name=..., ...) on a function")
            return self._tasks[consumer_name]
        policy = RetryPolicy(max_retries=max_retries, retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                             retry_jitter=retry_jitter)

        def decorate(fn: Callable[..., Any]) -> Any:
            if not callable(fn):
                raise ConfigError(f"@outbox.task decorates a function, got {type(fn).__name__}")
            task_name_ = name if name is not None else f"{fn.__module__}.{fn.__qualname__}"
            extra = options if version is None else {**options, "outbox_task_version": version}
            return idempotent_task.define(self.app, self, fn, name=task_name_, policy=policy, options=extra)

        return decorate if consumer_name is None else decorate(consumer_name)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the database connections of the engine this outbox built from ``database_url`` (an
        engine, session factory or Celery app you passed stays yours to close). Idempotent; a later use
        reconnects. Call it at the end of a test, a script or ``atexit``."""
        self.sessions.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- Celery wiring ---------------------------------------------------------------------------
    def _configure_app(self) -> None:
        conf = self.app.conf
        accept = conf.accept_content or []
        if any(a in ("pickle", "application/x-python-serialize", "yaml") for a in accept) or \
                conf.task_serializer not in (None, "json"):
            raise ConfigError("the outbox speaks JSON only: set accept_content=['json'] and task_serializer='json' "
                              "on your Celery app (never pickle)")
        # Redis-only rules (the visibility timeout) on the app's broker when the settings name none.
        problems = broker_relation_problems(self.settings, str(conf.broker_url or ""))
        if problems:
            raise ConfigError("; ".join(problems))
        self._add_queue(None)
        # The relay's periodic work for `celery beat`, and broker options the guarantees rely on; whatever
        # the app already sets wins (docs: README "Adopt it").
        conf.beat_schedule = {**beat_schedule(self.settings), **(conf.beat_schedule or {})}
        broker = str(self.settings.broker_url or conf.broker_url or "")
        options = dict(conf.broker_transport_options or {})
        if is_sentinel_url(broker):
            conf.broker_transport_options = {**redis_transport_options(self.settings),
                                             **sentinel_options(self.settings, broker, options), **options}
        elif broker_kind(broker) == "redis":
            conf.broker_transport_options = {**redis_transport_options(self.settings), **options}
        elif broker_kind(broker) == "rabbitmq":
            conf.broker_transport_options = {"confirm_publish": True, **options}

    def _add_queue(self, consumer: str | None) -> None:
        """Declare ``<namespace>.<consumer>`` (or the relay's queue) on the app, bound to the events exchange."""
        s = self.settings
        conf = self.app.conf
        args = queue_arguments(s, str(s.broker_url or conf.broker_url or ""))  # quorum or not, as everywhere
        if consumer is None:
            name = f"{s.namespace}.relay"
            queue = Queue(name, Exchange(name), routing_key=name, durable=True, queue_arguments=dict(args))
        else:
            name = s.queue_name(consumer)
            queue = Queue(name, Exchange(s.exchange_name, type="direct", durable=True), routing_key=name, durable=True,
                          queue_arguments=dict(args))
            add_task_routes(self.app, {task_name(consumer): {"queue": name}})
        queues = list(conf.task_queues or [])
        if not queues:
            default = conf.task_default_queue or "celery"
            queues.append(Queue(default, Exchange(conf.task_default_exchange or default),
                                routing_key=conf.task_default_routing_key or default))
        if all(q.name != name for q in queues):
            queues.append(queue)
        conf.task_queues = queues

    def _boot_check_step(self) -> type[bootsteps.Step]:
        """A worker boot step: a worker whose routes name an unknown consumer refuses to start."""
        outbox = self

        class OutboxCheck(bootsteps.Step):
            def __init__(self, parent: Any, **kwargs: Any) -> None:
                outbox.check()
                super().__init__(parent, **kwargs)  # type: ignore[no-untyped-call]

        return OutboxCheck
