"""Settings: one validated object passed in, with one precedence rule wherever it is built.

**Explicit arguments > ``OUTBOX_*`` environment variables > defaults.** ``Settings(namespace="shop")``
takes ``namespace`` from the code and every other field from its ``OUTBOX_<FIELD>`` variable when the
operator set one (``OUTBOX_ADMIN_TOKEN``, ``OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION``...), else its default.
``Settings.from_env(environ, **overrides)`` is the same rule over a given mapping (``from_env({}, ...)``:
no environment at all, for tests). ``replace()`` keeps every value it copies. The environment is read
when a ``Settings`` is built, never on import.

Every setting is declared once, below: ``name: type = setting(default, rule, doc=..., why=..., brokers=...)``.
From those declarations come the dataclass fields, ``Settings.RULES`` (how each variable is read, which
values it may take, whether it is a secret: masked in ``repr``/``str`` and in every error), the
environment reading (here, and the Django and Flask configuration readers that use ``RULES``) and the
per-setting tables of docs/settings.md (``python -m devtools settings-doc`` writes them; a test fails
when they differ). How a setting is declared and checked is in config/. Rules between fields are in
``Settings.RELATIONS``. A deployment's subclass adds settings the same way (``redeclare()`` changes a
parent's default); a field without a rule is a programming error caught the first time the class is built.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from celery_outbox.config.declare import BrokerRelation, Option, Relation, broker_kind, declared_options, setting, variable
from celery_outbox.config.rules import (
    DAY_MS,
    HOUR_MS,
    ChoiceRule,
    CrashPointsRule,
    FloatRule,
    IntRule,
    Invalid,
    PatternRule,
    PrefixRule,
    RoutesRule,
    Rule,
    TaskNamesRule,
    TokenRule,
    UrlRule,
    clause,
)
from celery_outbox.errors import ConfigError
from celery_outbox.schema import DEFAULT_PREFIX

LIBRARY_RELATIONS: tuple[Relation, ...] = (
    BrokerRelation("consumer_retry_backoff_max_s", "<", "broker_visibility_timeout_s",
                   "a retry waiting longer than the visibility timeout is delivered twice"),
    BrokerRelation("consumer_time_limit_s", "<", "broker_visibility_timeout_s",
                   "a delivery still running after the visibility timeout is delivered again"),
    BrokerRelation("relay_reconcile_after_ms", ">", "broker_visibility_timeout_s",
                   "the broker's own redelivery comes first, the reconciler only catches what is really lost (keep "
                   "a margin of two restore intervals)",
                   scale=1000, right_unit=" s"),
    Relation("broker_redelivery_window_ms", ">", "relay_reconcile_after_ms",
             "the inbox must outlive every redelivery and re-send, or one takes effect twice"),
    Relation("broker_redelivery_window_ms", ">", "relay_reconcile_plain_tasks_after_ms",
             "task receipts are pruned with the inbox and must outlive the plain-task window, or a task that ran "
             "is sent again"),
    Relation("relay_base_delay_ms", "<=", "relay_max_delay_ms", "the per-row backoff has a cap above its start"),
    Relation("relay_batch_size", "<=", "relay_max_in_flight_rows", "a batch is published whole before it is marked"),
    Relation("relay_breaker_base_ms", "<=", "relay_breaker_max_ms", "the breaker's backoff has a cap above its start"),
)

REDIS = ("redis",)
RABBITMQ = ("rabbitmq",)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the library. Pass one to ``Outbox``: explicit arguments > ``OUTBOX_*`` > defaults."""

    OPTIONS: ClassVar[Mapping[str, Option]]  # every declared setting's option (derived from the fields)
    RULES: ClassVar[Mapping[str, Rule]]  # every field's rule (derived from OPTIONS, plus a subclass's own table)
    RELATIONS: ClassVar[tuple[Relation, ...]] = LIBRARY_RELATIONS

    database_url: str = setting(
        "", UrlRule(("sqlite", "postgresql"), "sqlite:// or postgresql://"),
        doc="`postgresql://...` or `sqlite:///...`; empty: the engine or session factory given to `Outbox`")
    broker_url: str = setting(
        "", UrlRule(("redis", "rediss", "redis+socket", "sentinel", "amqp", "pyamqp", "amqps", "memory"),
                    "redis://..., sentinel://... or amqp://...", broker=True),
        doc="`redis://...`, `sentinel://...` (with `OUTBOX_BROKER_SENTINEL_MASTER`) or `amqp://...`; empty: the "
            "Celery app's own `broker_url`")
    namespace: str = setting(
        "outbox", PatternRule(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
                              "non-empty, without ' /#*': 1-64 letters, digits, '_', '-' or '.', starting with a "
                              "letter or digit"),
        doc="prefix of the exchange and queue names")
    table_prefix: str = setting(
        DEFAULT_PREFIX, PrefixRule(),
        doc="prefix of the library's table names (`outbox_messages`, `outbox_inbox`, ...)")
    routes: Mapping[str, tuple[str, ...]] = setting(
        factory=dict, rule=RoutesRule(),
        doc="event type -> consumers (`A=x,y;B=z`), merged over those the consumers declare in code "
            "(`@outbox.consumer`, `outbox.route()`); must name known consumers; an event type given twice or a "
            "consumer named twice in one route is refused")

    relay_batch_size: int = setting(
        100, IntRule(1, 10_000),
        doc="the first and smallest batch (rows per claim / publish / mark); it doubles while batches come back "
            "full and halves when they come back at most a quarter full")
    relay_max_in_flight_rows: int = setting(
        1_000, IntRule(1, 10_000),
        doc="the largest batch the adaptive relay grows to (relay/adaptive.py): the most rows published but not "
            "yet marked at any moment, so the most rows a relay crash re-publishes (the inbox absorbs them)")
    relay_poll_interval_s: float = setting(
        1.0, FloatRule(0.01, 86_400.0), doc="beat interval and the loop's fallback poll")
    relay_gather_ms: int = setting(
        20, IntRule(0, 1_000, zero="0 = off: claim at once"),
        doc="`outbox relay` on Postgres: after a NOTIFY wakes it, it waits this long for more commits before "
            "claiming, so one claim, publish, confirm wait and mark serve several commits; it does so only while "
            "the commit rate (the notifications it read, decayed over one second: relay/adaptive.py `CommitRate`) "
            "expects at least one more commit within the window (`GATHER_MIN_COMMITS` in relay/loop.py), so at "
            "20 ms it gathers from about 50 commits/s and below that it claims at once, and a trickle pays no "
            "latency; costs at most this much commit -> published latency, and only at those rates (measured: "
            "docs/benchmarks.md, \"Gathering from 50 commits/s\")")
    relay_listen_url: str = setting(
        "", UrlRule(("postgresql",), "empty (the database URL) or postgresql://"),
        doc="`outbox relay` on Postgres: the URL of its LISTEN connection, when the database URL goes through a "
            "transaction pooler (PgBouncer `pool_mode = transaction`), where LISTEN is accepted and hears nothing; "
            "give it a direct connection to the primary (docs/deployment.md, \"Behind PgBouncer\"). Empty: LISTEN "
            "through the database URL. Either way a probe NOTIFY, sent through the relay's sessions, must arrive "
            "on the new LISTEN connection within 2 s, or the relay says so in one warning line and polls every "
            "`OUTBOX_RELAY_POLL_INTERVAL_S`, trying LISTEN again 5 minutes later")
    relay_max_attempts: int = setting(
        10, IntRule(1, 1_000), why="the attempts column is a 32-bit integer",
        doc="a row the broker rejects this often is dead-lettered")
    relay_base_delay_ms: int = setting(
        1_000, IntRule(1, DAY_MS), doc="per-row backoff `base * 2^(attempts-1)`, capped at the maximum")
    relay_max_delay_ms: int = setting(300_000, IntRule(1, DAY_MS), doc="the cap of the per-row backoff")
    relay_breaker_base_ms: int = setting(
        1_000, IntRule(1, HOUR_MS), doc="relay-wide backoff while the broker is unreachable: its first wait")
    relay_breaker_max_ms: int = setting(60_000, IntRule(1, HOUR_MS), doc="the cap of the relay-wide backoff")
    relay_publish_timeout_s: float = setting(
        10.0, FloatRule(0.01, 3_600.0),
        doc="how long the relay waits for the broker to take (and confirm) one batch before the publish fails")
    relay_confirm_mode: str = setting(
        "confirm", ChoiceRule(("confirm", "tx", "none")), brokers=RABBITMQ,
        doc="durability per batch: `confirm` (publisher confirms per batch), `tx`, `none`")
    max_message_bytes: int = setting(
        256 * 1024, IntRule(1, 128 * 1024 * 1024), why="RabbitMQ's own maximum message size",
        doc="larger events are refused at write time and dead-lettered by relay and consumers")
    relay_reconcile_after_ms: int = setting(
        40_000, IntRule(1, 30 * DAY_MS),
        doc="the floor: a published event a consumer has not recorded, or an `@outbox.task` with no inbox row, "
            "older than this is re-sent (the event to that consumer only, the task with its own task id; "
            "relay/reconcile.py) once there is evidence it is lost: its consumer recorded messages queued after "
            "any copy of it could have been given back, or its queue holds no copy (docs/guarantees.md, \"When "
            "the reconciler re-sends\"); never on age alone, so a backlog is not re-sent. On Redis it must exceed "
            "the visibility timeout (plus kombu's restore scans), so the broker's own redelivery comes first. A "
            "message lost between broker and worker is back: on an otherwise idle queue within after + interval "
            "(+ a poll), about 45 s (RabbitMQ with consumers attached: one more floor); while its queue keeps "
            "flowing within 2 x (after + `OUTBOX_RELAY_PUBLISH_TIMEOUT_S` + interval) + interval after its "
            "consumer reached it, about 2 min; a consumer behind by L adds about 2 L")
    relay_reconcile_interval_s: float = setting(
        5.0, FloatRule(1.0, 86_400.0),
        doc="one reconcile pass per interval wherever the relay runs (beat task `celery_outbox.reconcile` or "
            "`outbox relay`)")
    relay_reconcile_plain_tasks_after_ms: int = setting(
        600_000, IntRule(0, 30 * DAY_MS, zero="0 = off: plain tasks are never sent again"),
        doc="a plain `@app.task` enqueued through the outbox that no worker has received (no receipt) this long "
            "after its publish is re-sent, on the same evidence as an event (never while its queue still holds "
            "it); never sooner than `OUTBOX_RELAY_RECONCILE_AFTER_MS`. Longer on purpose: "
            "a plain task has no inbox, so re-sending one that is merely still queued runs it twice. Set it the "
            "same in every relay and beat: a pass with 0 resets the window, so beside one with it on the window "
            "starts afresh every time (logged as a warning)")

    consumer_max_deliveries: int = setting(
        3, IntRule(1, 1_000), why="Celery max_retries; delivery counts are 32-bit columns",
        doc="deliveries before a consumer dead-letters a message, unless the consumer sets `max_retries` (then "
            "`max_retries + 1`; `retry_backoff`, `retry_backoff_max`, `retry_jitter` mean what they mean on "
            "`@app.task`)")
    consumer_retry_backoff_s: int = setting(
        1, IntRule(1, 86_400), doc="Celery retry countdown of a consumer, exponential from this")
    consumer_retry_backoff_max_s: int = setting(
        10, IntRule(1, 86_400),
        doc="the cap of the retry countdown; on Redis below the visibility timeout (a waiting retry is held "
            "unacked)")
    consumer_park_timeout_ms: int = setting(
        600_000, IntRule(1, 30 * DAY_MS), doc="per-entity ordering: how long an early version may wait")
    broker_redelivery_window_ms: int = setting(
        24 * 3600 * 1000, IntRule(1, 365 * DAY_MS), why="> 0: the inbox-prune guard cannot be turned off",
        doc="the inbox (and the plain tasks' receipts, pruned with it) is never pruned younger than this")
    broker_visibility_timeout_s: int = setting(
        30, IntRule(1, 7 * 86_400), brokers=REDIS,
        doc="unacked messages of a dead worker (killed whole) are redelivered after this + at most 2 x a tenth of "
            "it (1 to 30 s): 36 s by default. It must exceed the longest retry countdown (Redis holds ETA retries "
            "unacked too). Trade-off: a message a worker holds longer than this (a task still running, an `eta` "
            "or retry countdown it waits on) is delivered again on Redis: an idempotent consumer or "
            "`@outbox.task` absorbs the copy, a plain `@app.task` runs twice. Raise it together with "
            "`OUTBOX_CONSUMER_TIME_LIMIT_S` for slow work, and with it the reconcile delay (rules below); RabbitMQ "
            "redelivers a dead worker's messages when its connection closes and ignores it")

    max_json_depth: int = setting(
        64, IntRule(1, 500), why="below Python's recursion limit (1000), which the JSON decoder uses",
        doc="untrusted JSON (delivered bodies, HTTP bodies, stored payloads) nested deeper is refused")
    db_connect_timeout_s: int = setting(
        10, IntRule(1, 600), why="libpq: 0 would mean wait for ever",
        doc="Postgres connect timeout of every engine the library builds (a database that stops answering "
            "must not freeze anyone)")
    db_statement_timeout_ms: int = setting(
        30_000, IntRule(1, DAY_MS), why="Postgres: 0 would turn it off; int32 milliseconds",
        doc="Postgres `statement_timeout` per connection")
    db_idle_in_transaction_timeout_ms: int = setting(
        60_000, IntRule(1, DAY_MS), why="Postgres: 0 would turn it off; int32 milliseconds",
        doc="Postgres `idle_in_transaction_session_timeout` per connection")
    db_keepalives_idle_s: int = setting(
        30, IntRule(1, 32_767), why="Linux TCP_KEEPIDLE maximum",
        doc="TCP keepalives (and `tcp_user_timeout`) on Postgres connections: idle time before the first probe")
    db_keepalives_interval_s: int = setting(
        10, IntRule(1, 32_767), why="Linux TCP_KEEPINTVL maximum", doc="TCP keepalives: time between probes")
    db_keepalives_count: int = setting(
        3, IntRule(1, 127), why="Linux TCP_KEEPCNT maximum", doc="TCP keepalives: probes lost before the connection "
                                                                "is dropped")
    db_pre_ping_idle_ms: int = setting(
        1_000, IntRule(0, HOUR_MS, zero="0 = off: a ping on every checkout"),
        doc="a pooled connection idle in the pool longer than this is pinged at checkout (a dead one is replaced, "
            "with the rest of the pool); one used more recently is not (a ping per delivery was a round trip at "
            "saturation: db.py). A connection that died within this window fails its first statement: a consumer "
            "delivery or task receipt then runs once more on a new connection, uncounted; elsewhere (a web "
            "request) that one call fails")
    consumer_time_limit_s: int = setting(
        20, IntRule(1, 86_400),
        doc="hard time limit of a consumer delivery or `@outbox.task` run (killed, requeued and counted: no hang "
            "for ever); on Redis below the visibility timeout")

    enqueue_outside_transaction: str = setting(
        "own_transaction", ChoiceRule(("own_transaction", "raise", "publish")),
        doc="a Celery task sent (`task.delay()`) with no transaction bound by `outbox.transaction(session)` or "
            "Django's `atomic()` (celery/enqueue.py): `own_transaction` (a row committed on its own inside "
            "`delay()`: durable, not atomic with earlier writes), `raise` (nothing sent) or `publish` (sent "
            "directly, plain Celery)")
    enqueue_exclude: tuple[str, ...] = setting(
        (), TaskNamesRule(), doc="task names never captured into the outbox, comma-separated")
    enqueue_hold_eta_after_ms: int = setting(
        1_000, IntRule(1, 365 * DAY_MS),
        doc="a captured task whose eta (countdown) is further ahead is held as an outbox row until due and "
            "published then without an eta, so no worker holds it unacked ([docs/scheduled.md](scheduled.md))")
    worker_heartbeat_ms: int = setting(
        10_000, IntRule(0, HOUR_MS, zero="0 = off: workers do not register, the relay holds nothing"),
        doc="deploy-safe publishing (workers.py): each worker registers its queues and task names (with versions) "
            "in `outbox_workers` and refreshes them this often; the relay holds a task row a live registered "
            "worker of its queue cannot run (a rolling deploy); a worker silent for 3 heartbeats is not live "
            "([docs/scheduled.md](scheduled.md), \"Deploys\")")
    relay_hold_recheck_ms: int = setting(
        2_000, IntRule(10, HOUR_MS),
        doc="a task row held for a worker is looked at again this long after, no attempt charged")

    metrics_port: int = setting(
        0, IntRule(0, 65_535, zero="0 = off"),
        doc="worker `/metrics` port (the Flask app always serves `/metrics`)")
    admin_token: str = setting(
        "", TokenRule(),
        doc="enables `/admin/dead-letters` (bearer token or basic-auth password); a secret, never shown")
    crash_points: str = setting(
        "", CrashPointsRule(),
        doc="chaos testing only: names armed to kill the process there (an unknown name, a malformed N or a "
            "point given twice is refused)")
    tracer_provider: str = setting(
        "", PatternRule(r"(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)?",
                        "empty or module.path:function (returning an OpenTelemetry TracerProvider)"),
        doc="`module:function` returning an OpenTelemetry `TracerProvider`, installed in every process that runs "
            "outbox work: where the Outbox is built and in each worker pool process (celery/tracing_hook.py)")
    broker_queue_type: str = setting(
        "classic", ChoiceRule(("classic", "quorum")), brokers=RABBITMQ,
        doc="`quorum` declares the consumer, task and relay queues as quorum queues (replicated over a cluster; "
            "`x-delivery-limit` = max(20, 2 x `OUTBOX_CONSUMER_MAX_DELIVERIES`): celery/config.py); an error with "
            "Redis. A cluster's broker URL lists every node: "
            "`amqp://u:p@node1:5672//;amqp://u:p@node2:5672//;amqp://u:p@node3:5672//` (docs/scaling.md)")
    broker_sentinel_master: str = setting(
        "", PatternRule(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,63})?",
                        "empty or the Sentinel master's name: 1-64 letters, digits, '_', '-' or '.', starting with a "
                        "letter or digit"), brokers=REDIS,
        doc="Redis behind Sentinel: the master's name (the `<name>` of the sentinels' `sentinel monitor <name> "
            "...`), needed with a `sentinel://` broker URL, which lists every sentinel: "
            "`sentinel://:pass@s1:26379/0;sentinel://:pass@s2:26379/0;sentinel://:pass@s3:26379/0`. Every "
            "connection the library opens gets it as kombu's `master_name` transport option; the Celery app's "
            "own `broker_transport_options={'master_name': ...}` wins (celery/config.py `sentinel_options`, "
            "docs/deployment.md)")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # ``@dataclass`` on a subclass would generate a repr showing every value, passwords included;
        # it keeps a ``__repr__`` the class itself defines, so every subclass gets the masking one.
        super().__init_subclass__(**kwargs)
        for name in ("__repr__", "__str__"):
            if name not in cls.__dict__:
                setattr(cls, name, Settings.__dict__[name])
        # Before ``@dataclass`` runs: the body's ``setting()`` fields are still in the class namespace.
        cls._declare(dict(cls.__dict__))

    @classmethod
    def _declare(cls, namespace: Mapping[str, Any]) -> None:
        """``OPTIONS`` and ``RULES`` of this class: its parent's, with the settings its body declares over them.
        A ``RULES`` table the body gives (the older way to extend it) is kept, under the declared rules."""
        inherited: Mapping[str, Option] = getattr(cls, "OPTIONS", {})
        own = declared_options(namespace, inherited, cls.__qualname__)
        rules = dict(namespace["RULES"] if "RULES" in namespace else getattr(cls, "RULES", {}))
        rules.update((name, option.rule) for name, option in own.items())
        cls.OPTIONS = {**inherited, **own}
        cls.RULES = rules

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={self._shown(f.name)}" for f in dataclasses.fields(self) if f.repr)
        return f"{type(self).__qualname__}({shown})"

    __str__ = __repr__

    def _shown(self, name: str) -> str:
        value = getattr(self, name)
        rule = self.RULES.get(name)
        return repr(rule.masked(value) if rule is not None else value)

    @property
    def effective_database_url(self) -> str:
        if not self.database_url:
            raise ConfigError("no database: set OUTBOX_DATABASE_URL or pass engine=/session_factory= to Outbox")
        return self.database_url

    @property
    def exchange_name(self) -> str:
        return f"{self.namespace}.events"

    def queue_name(self, consumer: str) -> str:
        return f"{self.namespace}.{consumer}"

    @property
    def consumers(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for names in self.routes.values():
            for name in names:
                seen[name] = None
        return tuple(seen)

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Which fields the caller gave: only the others are read from the environment (``__post_init__``).
        self = super().__new__(cls)
        object.__setattr__(self, "_explicit", frozenset(kwargs))
        return self

    def __post_init__(self) -> None:
        explicit = self.__dict__.pop("_explicit", None)
        names = {f.name for f in dataclasses.fields(self)}
        if explicit is not None and not names <= explicit:
            for name, value in self._read_env(os.environ, skip=explicit).items():
                object.__setattr__(self, name, value)
        rules = self._rules()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            normal = rules[f.name].normalize(value)
            if normal is not value:
                object.__setattr__(self, f.name, normal)  # frozen: the canonical form, once, before validation
        self.validate()

    def allows_broker_alias(self, url: str) -> bool:
        """A deployment may accept a named broker (the demo's "embedded"); the library accepts none."""
        return False

    def kind_of_broker(self, url: object) -> str | None:
        """Which broker ``url`` is (``broker_kind``); a deployment names what its aliases are."""
        return broker_kind(url)

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The ``OUTBOX_*`` variables that make a child process build these same settings (secrets included)."""
        rules = self._rules()
        return {variable(f.name): rules[f.name].as_env(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """``overrides`` > ``OUTBOX_<FIELD>`` variables of ``environ`` (``os.environ`` by default) > defaults.

        Any bad value raises one ``ConfigError`` whose message is one line: a clause per bad variable,
        naming it, separated by ``; `` (a secret's value is never repeated).
        """
        values = cls._read_env(os.environ if environ is None else environ, skip=frozenset(overrides))
        for f in dataclasses.fields(cls):  # every field given: the constructor reads no other environment
            if f.name not in values and f.name not in overrides and f.init:
                if f.default is not dataclasses.MISSING:
                    values[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    values[f.name] = f.default_factory()
        values.update(overrides)
        return cls(**values)

    @classmethod
    def _read_env(cls, env: Mapping[str, str], *, skip: frozenset[str]) -> dict[str, Any]:
        """The fields (except ``skip``) whose ``OUTBOX_<FIELD>`` variable ``env`` sets, parsed by their rule."""
        rules = cls._rules()
        values: dict[str, Any] = {}
        errors: list[str] = []
        for f in dataclasses.fields(cls):
            key = variable(f.name)
            if key not in env or f.name in skip:
                continue
            raw = env[key]
            rule = rules[f.name]
            try:
                values[f.name] = rule.parse(raw)
            except Invalid as e:
                errors.append(clause(key, str(e), raw, rule))
        if errors:
            raise ConfigError("; ".join(errors))
        return values

    @classmethod
    def _rules(cls) -> Mapping[str, Rule]:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in cls.RULES]
        if missing:  # a programming error: every field states its rule
            raise TypeError(f"{cls.__qualname__}: no rule in RULES for {', '.join(missing)}")
        return cls.RULES

    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every bad field (one line); see ``RULES`` and ``RELATIONS``."""
        rules = self._rules()
        errors: list[str] = []
        bad: set[str] = set()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rule = rules[f.name]
            trouble = rule.problem(value, self)
            if trouble is not None:
                bad.add(f.name)
                errors.append(clause(variable(f.name), trouble, value, rule))
        for relation in self.RELATIONS:
            if not bad.intersection(relation.fields) and not relation.holds(self):
                errors.append(relation.explain(self))
        if errors:
            raise ConfigError("; ".join(errors))


Settings._declare({f.name: f for f in dataclasses.fields(Settings)})


def broker_relation_problems(settings: Settings, broker_url: str) -> list[str]:
    """The broker rules ``settings`` breaks on the broker at ``broker_url`` (the Celery app's, when
    ``settings.broker_url`` is empty; a non-empty one was checked when the settings were built)."""
    if settings.broker_url:
        return []
    return [r.explain(settings) for r in settings.RELATIONS
            if isinstance(r, BrokerRelation) and r.applies(settings, broker_url) and not r.compare(settings)]
