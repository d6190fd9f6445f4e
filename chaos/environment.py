"""One chaos environment: a Postgres database of its own, a broker, a namespace, and the processes.

Used by ``run_chaos`` and by every test in tests/chaos, so both provoke failures the same way:
real ``outbox relay`` and ``celery worker`` subprocesses, configured only through ``OUTBOX_*``
variables, killed with SIGKILL. Leaving the context kills every process it started (by its own id),
drops the database and deletes the namespace's queues.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.messages import Envelope, TaskMessage, celery_task_message, encode_json, task_id, task_name
from celery_outbox.schema import Tables, define_tables
from celeryconfig import TASK_QUEUES, Settings
from chaos.broker import RabbitBroker, RedisBroker, TakenMessage, TcpProxy, make_broker
from chaos.cluster import ClusterBroker
from chaos.processes import ManagedProcess, ProcessGroup, beat_argv, orders_argv, relay_argv, worker_argv
from chaos.sentinel import SentinelBroker
from orders import migrate

PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REPO = Path(__file__).resolve().parent.parent

# Fast failure handling so a short run sees backoff, breaker and redelivery happen.
CHAOS_ENV: dict[str, str] = {
    "OUTBOX_RELAY_POLL_INTERVAL_S": "0.3",
    "OUTBOX_RELAY_BATCH_SIZE": "20",
    "OUTBOX_RELAY_MAX_ATTEMPTS": "3",
    "OUTBOX_RELAY_BASE_DELAY_MS": "200",
    "OUTBOX_RELAY_MAX_DELAY_MS": "2000",
    "OUTBOX_RELAY_BREAKER_BASE_MS": "200",
    "OUTBOX_RELAY_BREAKER_MAX_MS": "1000",
    "OUTBOX_RELAY_PUBLISH_TIMEOUT_S": "3",
    "OUTBOX_CONSUMER_MAX_DELIVERIES": "3",
    "OUTBOX_CONSUMER_RETRY_BACKOFF_S": "1",
    "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "2",
    "OUTBOX_BROKER_VISIBILITY_TIMEOUT_S": "10",  # see celery_outbox.celery.config.redis_transport_options
    "OUTBOX_CONSUMER_TIME_LIMIT_S": "8",  # below the visibility timeout (Settings enforces it)
    # The reconciler re-sends what no consumer recorded 12 s after its publish (above the visibility
    # timeout, so Redis redelivers a killed worker's unacked message first), checking every second:
    # a message lost in the take window comes back within the run, not 10 minutes later.
    "OUTBOX_RELAY_RECONCILE_AFTER_MS": "12000",
    "OUTBOX_RELAY_RECONCILE_INTERVAL_S": "1",
}


class ChaosEnvironment:
    """See the module docstring. ``broker`` is ``"redis"`` (own server) or ``"rabbitmq"`` (shared).

    ``tables`` are the library's mapped tables to read the database through (the processes use the
    default prefix too); pass one ``define_tables()`` result to share it between environments.
    """

    def __init__(self, *, broker: str, workdir: Path, pg_admin_url: str = PG_ADMIN_URL,
                 namespace: str | None = None, extra_env: Mapping[str, str] | None = None,
                 tables: Tables | None = None, db_proxy: bool = False,
                 broker_impl: ClusterBroker | SentinelBroker | None = None,
                 prefetch_multiplier: int | None = None) -> None:
        self.kind = broker
        # None: the deployment's own (celeryconfig.PREFETCH_MULTIPLIER); else every consumer worker's
        # ``--prefetch-multiplier`` (run_chaos: a short run's take window on RabbitMQ)
        self.prefetch_multiplier = prefetch_multiplier
        self.workdir = workdir
        self.pg_admin_url = pg_admin_url
        self.namespace = namespace or f"chaos{uuid.uuid4().hex[:10]}"
        self.db_name = f"outbox_chaos_{uuid.uuid4().hex[:10]}"
        # the admin URL with the database replaced; a multi-host URL (``?host=a:1&host=b:2``) keeps its hosts
        self.database_url = sa.make_url(pg_admin_url).set(database=self.db_name).render_as_string(hide_password=False)
        # ``db_proxy``: the processes reach Postgres through a loopback proxy the run can freeze
        # (``freeze_database``); the environment's own sessions connect directly, so it sees through it.
        self.db_proxy: TcpProxy | None = None
        self.process_database_url = self.database_url
        if db_proxy:
            url = sa.make_url(self.database_url)
            self.db_proxy = TcpProxy(target=(url.host or "127.0.0.1", url.port or 5432))
            self.process_database_url = url.set(host="127.0.0.1", port=self.db_proxy.port).render_as_string(
                hide_password=False)
        # ``broker_impl``: a broker started outside the environment (a RabbitMQ cluster, chaos/cluster.py;
        # Redis behind Sentinel, chaos/sentinel.py)
        self.broker: RedisBroker | RabbitBroker | ClusterBroker | SentinelBroker = (
            broker_impl if broker_impl is not None else make_broker(broker, data_dir=workdir / "redis"))
        self.processes = ProcessGroup()
        self.extra_env = dict(extra_env or {})
        self.tables = tables if tables is not None else define_tables(prefix=self.settings.table_prefix)
        if self.tables.prefix != self.settings.table_prefix:
            raise ValueError(f"tables of prefix {self.tables.prefix!r}, processes use {self.settings.table_prefix!r}")
        self._engine: sa.Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._plans = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> ChaosEnvironment:
        self.workdir.mkdir(parents=True, exist_ok=True)
        admin = make_engine(self.pg_admin_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as c:
                c.exec_driver_sql(f'CREATE DATABASE "{self.db_name}"')
        finally:
            admin.dispose()
        try:
            migrate.upgrade(self.database_url)
            self._engine = make_engine(self.database_url)
            self._sessions = make_session_factory(self._engine)
            if self.db_proxy is not None:
                self.db_proxy.start()
            self.broker.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.processes.kill_all()
        queues = list(self.settings.worker_queues)
        if self.db_proxy is not None:
            self.db_proxy.cut()
        try:
            self.broker.close(namespace=self.namespace, queues=queues)
        finally:
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None
            admin = make_engine(self.pg_admin_url, isolation_level="AUTOCOMMIT")
            try:
                with admin.connect() as c:
                    c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
            finally:
                admin.dispose()

    # -- configuration -----------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        env = {
            **CHAOS_ENV,
            "OUTBOX_DATABASE_URL": self.process_database_url,
            "OUTBOX_BROKER_URL": self.broker.url,
            "OUTBOX_NAMESPACE": self.namespace,
            "OUTBOX_HOME": str(self.workdir / "home"),
            **self.extra_env,
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
        return env

    @property
    def settings(self) -> Settings:
        return Settings.from_env({k: v for k, v in self.env.items() if k in _SETTINGS_KEYS})

    @property
    def consumers(self) -> tuple[str, ...]:
        return self.settings.consumers

    @property
    def deliveries(self) -> tuple[str, ...]:
        """Where each committed order ends up: every consumer of OrderPlaced, then the tasks' queues (the
        confirmation e-mail's ``email``); the keys of ``Snapshot.effects`` and ``queue_depths``."""
        return (*self.consumers, *TASK_QUEUES.values())

    @property
    def sessions(self) -> sessionmaker[Session]:
        assert self._sessions is not None, "use the environment as a context manager"
        return self._sessions

    # -- processes ---------------------------------------------------------------------------------
    def relay(self, name: str = "relay", *, args: Sequence[str] = ()) -> ManagedProcess:
        return self.processes.add(ManagedProcess(name=name, argv=[*relay_argv(), *args], env=self.env,
                                                 log_dir=self.workdir / "logs", cwd=REPO))

    def worker(self, name: str = "worker", *, queues: Iterable[str] | None = None, pool: str | None = None,
               concurrency: int = 2) -> ManagedProcess:
        """A real ``celery worker``. On Redis the default pool is solo: kombu's Redis transport takes a
        message with BRPOP and only then records it as unacked (HSET), so a worker SIGKILLed whole
        while its consumer thread sits between the two loses that message (seen in a chaos run; no
        inbox can repair it). With solo the consumer and the task share one thread, so a crash point
        inside a task never lands in that window. RabbitMQ tracks unacked messages itself: threads."""
        if pool is None:
            pool = "solo" if self.kind == "redis" else "threads"
        if pool == "solo":
            concurrency = 1
        # By default every queue but the relay's (the relay is its own process here): the consumers' and
        # the tasks' (the confirmation e-mail, orders/tasks.py).
        names = ([self.settings.queue_name(c) for c in queues] if queues
                 else [q for q in self.settings.worker_queues if q != f"{self.namespace}.relay"])
        argv = worker_argv(queues=names, pool=pool, concurrency=concurrency, hostname=f"{name}-{self.namespace}")
        if self.prefetch_multiplier is not None:
            argv += ["--prefetch-multiplier", str(self.prefetch_multiplier)]
        return self.processes.add(ManagedProcess(name=name, argv=argv, env=self.env,
                                                 log_dir=self.workdir / "logs", cwd=REPO))

    def relay_worker(self, name: str = "relay") -> ManagedProcess:
        """A ``celery worker`` of the relay queue only: the relay as beat drives it (drain and reconcile
        tasks). Solo pool, so a relay crash point reached in a drain kills the whole process."""
        argv = worker_argv(queues=[f"{self.namespace}.relay"], pool="solo", concurrency=1,
                           hostname=f"{name}-{self.namespace}")
        return self.processes.add(ManagedProcess(name=name, argv=argv, env=self.env,
                                                 log_dir=self.workdir / "logs", cwd=REPO))

    def beat(self, name: str = "beat") -> ManagedProcess:
        """A real ``celery beat`` of the deployment: schedules drain, reconcile and retention."""
        argv = beat_argv(schedule=self.workdir / "home" / f"{name}-schedule")
        return self.processes.add(ManagedProcess(name=name, argv=argv, env=self.env,
                                                 log_dir=self.workdir / "logs", cwd=REPO))

    def orders(self, plan: Sequence[Mapping[str, Any]], *, name: str = "orders",
               interval_ms: int = 0) -> ManagedProcess:
        self._plans += 1
        path = self.workdir / f"plan-{self._plans}.json"
        path.write_text(encode_json(list(plan)))
        return self.processes.add(ManagedProcess(name=name, argv=orders_argv(plan=path, interval_ms=interval_ms),
                                                 env=self.env, log_dir=self.workdir / "logs", cwd=REPO))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (log {p.log_path}) ---\n{p.tail()}" for p in self.processes.members)

    # -- the database ------------------------------------------------------------------------------
    def scalar(self, stmt: Any) -> Any:
        with self.sessions() as s:
            return s.execute(stmt).scalar_one()

    def count(self, model: Any, *where: Any) -> int:
        return int(self.scalar(sa.select(sa.func.count()).select_from(model).where(*where)))

    def pending(self) -> int:
        outbox = self.tables.outbox
        return self.count(outbox, outbox.published_at_ms.is_(None), outbox.dead_lettered_at_ms.is_(None))

    def wait(self, predicate: Callable[[], bool], *, timeout_s: float = 60.0, what: str = "condition") -> None:
        """Poll ``predicate`` until true; on timeout raise with every process's log tail."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def repend(self, seqs: Sequence[int]) -> int:
        """Mark published rows pending again: the relay publishes them a second time (duplicates)."""
        with self.sessions() as s:
            outbox = self.tables.outbox
            res = s.execute(sa.update(outbox).where(outbox.seq.in_(list(seqs)), outbox.published_at_ms.is_not(None))
                            .values(published_at_ms=None, next_attempt_at_ms=0))
            s.commit()
            return int(getattr(res, "rowcount", 0) or 0)

    # -- the broker --------------------------------------------------------------------------------
    def publish(self, messages: Sequence[TaskMessage]) -> None:
        """Put task messages straight on consumer queues (poison, duplicates), through the real publisher."""
        from celery_outbox.celery.kombu_publisher import KombuPublisher

        with KombuPublisher(broker_url=self.broker.url, settings=self.settings) as publisher:
            report = publisher.publish_batch(list(messages))
        if report.rejected:
            raise RuntimeError(f"broker rejected injected messages: {dict(report.rejected)}")

    def queue_depths(self) -> dict[str, int]:
        """Ready messages per consumer or task queue, as the broker reports them (a slow consumer's backlog)."""
        from kombu import Connection, Queue

        depths: dict[str, int] = {}
        with Connection(self.broker.url, connect_timeout=5) as conn:
            channel = conn.channel()
            for c in self.deliveries:
                _, count, _ = Queue(self.settings.queue_name(c), channel=channel).queue_declare()
                depths[c] = int(count)
        return depths

    def take_and_lose(self, delivery: str, *, exclude: Iterable[str] = ()) -> TakenMessage | None:
        """Remove from ``delivery``'s queue (a consumer, or ``email``) one message whose outbox row is
        already marked published, that nobody has recorded and whose message id is not in ``exclude``,
        before any worker took it: the state a worker SIGKILLed between take and record leaves
        (chaos/broker.py). None if the queue holds no such message right now."""
        skip = set(exclude)
        outbox, inbox = self.tables.outbox, self.tables.inbox
        tasks = {queue: task for task, queue in TASK_QUEUES.items()}
        recorder = task_key(tasks[delivery]) if delivery in tasks else delivery

        def lose(headers: Mapping[str, Any]) -> bool:
            mid = str(headers.get("outbox_message_id") or headers.get("id") or "")
            try:
                key = uuid.UUID(mid)
            except ValueError:
                return False
            return (mid not in skip
                    and self.count(outbox, outbox.message_id == key, outbox.published_at_ms.is_not(None)) == 1
                    and self.count(inbox, inbox.message_id == key, inbox.consumer == recorder) == 0)

        return self.broker.take_and_lose(queue=self.settings.queue_name(delivery), wanted=lose)

    def task_message(self, envelope: Envelope, consumer: str) -> TaskMessage:
        return celery_task_message(envelope, consumer=consumer, routing_key=self.settings.queue_name(consumer))

    def raw_task_message(self, *, consumer: str, body_arg: Any, message_id: uuid.UUID) -> TaskMessage:
        """A task message whose argument is anything at all (a poison body), with a real task header."""
        tid = task_id()
        body = encode_json([[body_arg], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
        headers: dict[str, Any] = {
            "lang": "py", "task": task_name(consumer), "id": tid, "root_id": tid, "parent_id": None,
            "group": None, "retries": 0, "eta": None, "expires": None, "timelimit": [None, None],
            "argsrepr": "(poison)", "kwargsrepr": "{}", "origin": "chaos", "ignore_result": True,
            "outbox_message_id": str(message_id), "outbox_type": "poison",
        }
        return TaskMessage(consumer=consumer, routing_key=self.settings.queue_name(consumer), body=body,
                           headers=headers, properties={"correlation_id": tid, "message_id": str(message_id)})

    def poison(self, *, consumer: str) -> tuple[str, str]:
        """Inject one message this consumer can never process (its payload lacks every field).

        Returns the (consumer, message_id) the dead-letter store must end up holding.
        """
        mid = uuid.uuid4()
        body = {"message_id": str(mid), "type": "OrderPlaced", "payload": {"poison": True}, "headers": {},
                "created_at_ms": 0}
        self.publish([self.raw_task_message(consumer=consumer, body_arg=body, message_id=mid)])
        return consumer, str(mid)

    def duplicate(self, seq: int, *, copies: int = 2, consumers: Iterable[str] | None = None) -> int:
        """Publish an already published row ``copies`` times more to each consumer, at once; returns
        the number of extra deliveries injected."""
        with self.sessions() as s:
            row = s.get(self.tables.outbox, seq)
            assert row is not None, f"no outbox row {seq}"
            envelope = Envelope(message_id=row.message_id, type=row.type, payload=row.payload,
                                headers=dict(row.headers or {}), created_at_ms=row.created_at_ms)
        names = list(consumers or self.consumers)
        messages = [self.task_message(envelope, c) for c in names for _ in range(copies)]
        self.publish(messages)
        return len(messages)


_SETTINGS_KEYS = {f"OUTBOX_{name.upper()}" for name in Settings.__dataclass_fields__}
