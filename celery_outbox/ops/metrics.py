"""Prometheus metrics.

Everything is read from the database at scrape time (``OutboxCollector``), gauges and counters alike:
the same figures from every process (web app, relay, prefork worker children, which in-process
counters could not sum without prometheus-client's multiprocess mode) and they survive restarts.
The counters are kept by the work they count, in its own transaction (``outbox.counters``): the
relay's mark, a consumer's dead letter, a retention batch; "processed" is derived (inbox rows plus
pruned inbox rows) so the consumer's hot path writes nothing extra.

The broker's side, when a queue probe is given (``celery_outbox.celery.queue_depth.queue_probe``, which the
worker's server and the Flask app pass): messages waiting in each consumer's queue and, on RabbitMQ, how many
consumers are attached. So a consumer whose queue fills while no worker takes from it is visible; Redis
cannot tell who listens, so there only the depth is exported. The probe is asked at scrape time like the
database; a broker it cannot reach gives ``outbox_queue_probe_up 0``, never an error.

Endpoints: ``GET /metrics`` on the Flask app (``celery_outbox.contrib.flask.init_app``), and ``start_worker_metrics_server``
which a Celery ``worker_ready`` signal calls in the worker's main process on ``settings.metrics_port``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.clock import Clock, SystemClock
from celery_outbox.ops import stats as ops_stats
from celery_outbox.ops.partitions import Headroom
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, kw_only=True)
class QueueDepth:
    """One consumer queue as the broker reports it; ``consumers`` is None where the broker cannot tell (Redis)."""

    queue: str
    consumer: str
    messages: int
    consumers: int | None = None


QueueProbe = Callable[[], Sequence[QueueDepth]]


def _queue_families() -> dict[str, GaugeMetricFamily]:
    return {
        "up": GaugeMetricFamily("outbox_queue_probe_up", "1 if the last scrape could read the consumer queues' depths"),
        "messages": GaugeMetricFamily("outbox_queue_messages", "Messages waiting in a consumer's queue (ready, not "
                                      "taken by a worker)", labels=["queue", "consumer"]),
        "consumers": GaugeMetricFamily("outbox_queue_consumers", "Consumers attached to a consumer's queue "
                                       "(RabbitMQ only: Redis cannot tell)", labels=["queue", "consumer"]),
    }


def _vacuum_families() -> dict[str, GaugeMetricFamily]:
    """Postgres only (docs/operations.md, "Vacuum and bloat"): absent on SQLite, not zero."""
    return {
        "xact_xids": GaugeMetricFamily(
            "outbox_db_oldest_xact_age_xids",
            "Postgres: age in transaction ids of the oldest transaction holding back vacuum in the outbox's database "
            "(sessions, walsenders, prepared transactions; autovacuum workers excluded; 0 when none)"),
        "xact_seconds": GaugeMetricFamily(
            "outbox_db_oldest_xact_seconds",
            "Postgres: how long the longest-open transaction holding back vacuum has been open (0 when none)"),
        "slot_xids": GaugeMetricFamily(
            "outbox_db_replication_slot_xmin_age_xids",
            "Postgres: age in transaction ids of the oldest replication slot horizon, kind=xmin (holds every "
            "table's dead tuples) or catalog_xmin (the catalogs'); 0 when no slot holds one", labels=["kind"]),
        "dead": GaugeMetricFamily("outbox_table_dead_tuples",
                                  "Postgres: dead tuples of the outbox and inbox tables (pg_stat_user_tables, an "
                                  "estimate)", labels=["table"]),
        "live": GaugeMetricFamily("outbox_table_live_tuples",
                                  "Postgres: live tuples of the outbox and inbox tables (an estimate)", labels=["table"]),
        "vacuumed": GaugeMetricFamily("outbox_table_last_vacuum_timestamp_seconds",
                                      "Postgres: when the table was last vacuumed, kind=auto (autovacuum) or manual "
                                      "(0: never since the statistics were reset)", labels=["table", "kind"]),
    }


def _partition_families() -> dict[str, GaugeMetricFamily]:
    """The partitioned layout only (docs/partitioning.md, "Partitions ahead"): absent on the plain table."""
    return {
        "rows": GaugeMetricFamily("outbox_partition_headroom_rows",
                                  "Partitioned outbox: rows the table takes before a write fails for want of a "
                                  "partition (the next seq to the top of the last partition)"),
        "ahead": GaugeMetricFamily("outbox_partitions_ahead",
                                   "Partitioned outbox: that headroom in partitions of the newest one's size; the "
                                   "prune keeps it at --ahead, so it falls only when no prune runs"),
    }


def _partition_metrics(h: Headroom) -> Iterator[Metric]:
    fam = _partition_families()
    fam["rows"].add_metric([], h.rows)
    fam["ahead"].add_metric([], h.ahead)
    yield from fam.values()


def _vacuum_metrics(v: ops_stats.VacuumStats) -> Iterator[Metric]:
    fam = _vacuum_families()
    fam["xact_xids"].add_metric([], v.oldest_xact_age_xids or 0)
    fam["xact_seconds"].add_metric([], (v.oldest_xact_age_ms or 0) / 1000)
    fam["slot_xids"].add_metric(["xmin"], max((s.xmin_age_xids or 0 for s in v.slots), default=0))
    fam["slot_xids"].add_metric(["catalog_xmin"], max((s.catalog_xmin_age_xids or 0 for s in v.slots), default=0))
    for t in v.tables:
        fam["dead"].add_metric([t.table], t.dead_tuples)
        fam["live"].add_metric([t.table], t.live_tuples)
        fam["vacuumed"].add_metric([t.table, "auto"], (t.last_autovacuum_ms or 0) / 1000)
        fam["vacuumed"].add_metric([t.table, "manual"], (t.last_vacuum_ms or 0) / 1000)
    yield from fam.values()


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "up": GaugeMetricFamily("outbox_stats_up", "1 if the last scrape could read the outbox database"),
        "pending": GaugeMetricFamily("outbox_pending_messages", "Outbox rows not yet published (excl. dead)"),
        "due": GaugeMetricFamily("outbox_due_messages", "Pending outbox rows whose backoff has passed"),
        "retrying": GaugeMetricFamily("outbox_retrying_messages",
                                      "Pending outbox rows that failed to publish at least once"),
        "oldest": GaugeMetricFamily("outbox_oldest_pending_age_seconds",
                                    "How long the longest-waiting pending outbox row has waited to go out, "
                                    "scheduled rows apart (0 when none)"),
        "scheduled": GaugeMetricFamily("outbox_scheduled_messages",
                                       "Pending outbox rows held for a later eta (not a backlog)"),
        "overdue": GaugeMetricFamily("outbox_oldest_overdue_seconds",
                                     "How long the longest-due pending row has been due and unpublished (0 when "
                                     "none); rows backing off after a failed publish are not due, so it grows only "
                                     "when no relay claims due rows"),
        "claim_held": GaugeMetricFamily("outbox_relay_claim_held_seconds",
                                        "Postgres: how long the oldest relay claim (rows locked, mark not committed) "
                                        "has been open (0 when none; always 0 on SQLite)"),
        "waiting_for_worker": GaugeMetricFamily(
            "outbox_waiting_for_worker_messages",
            "Task rows the relay holds because a live worker of their queue does not run them yet (a deploy)",
            labels=["waiting_for"]),
        "published": GaugeMetricFamily("outbox_published_retained_messages",
                                       "Published outbox rows not yet pruned by retention"),
        "dead": GaugeMetricFamily("outbox_dead_letters", "Unreplayed dead letters",
                                  labels=["source", "consumer"]),
        "dead_age": GaugeMetricFamily("outbox_dead_letter_oldest_age_seconds",
                                      "Age of the oldest unreplayed dead letter", labels=["source", "consumer"]),
        "inbox": GaugeMetricFamily("outbox_inbox_entries", "Inbox rows (processed messages kept for dedup)",
                                   labels=["consumer"]),
        "dups": CounterMetricFamily("outbox_duplicates_absorbed", "Duplicate deliveries the inbox absorbed",
                                    labels=["consumer"]),
        "batches": CounterMetricFamily("outbox_consumer_batches", "Batches a batch consumer committed",
                                       labels=["consumer"]),
        "batched": CounterMetricFamily("outbox_consumer_batched_messages",
                                       "Messages in those batches (mean batch size = this / outbox_consumer_batches)",
                                       labels=["consumer"]),
        "published_total": CounterMetricFamily("outbox_relay_published", "Outbox rows the relay published"),
        "failures_total": CounterMetricFamily("outbox_relay_publish_failures",
                                              "Failed publish attempts: a message the broker rejected (charged to "
                                              "the row) or a batch the broker was unreachable for", labels=["kind"]),
        "processed_total": CounterMetricFamily("outbox_consumer_processed",
                                               "Deliveries processed (effect committed): inbox rows + pruned ones",
                                               labels=["consumer"]),
        "dead_total": CounterMetricFamily("outbox_dead_lettered", "Messages dead-lettered",
                                          labels=["source", "consumer"]),
        "reconciled_total": CounterMetricFamily("outbox_relay_reconciled",
                                                "Messages the reconciler published again because they never "
                                                "arrived: (event, consumer) pairs, @outbox.task and plain tasks",
                                                labels=["kind"]),
    }


class OutboxCollector(Collector):
    """Reads the database on every scrape; a failed read yields ``outbox_stats_up 0`` instead of an error."""

    def __init__(self, *, tables: Tables, session_factory: sessionmaker[Session], clock: Clock | None = None,
                 queue_probe: QueueProbe | None = None) -> None:
        self._tables = tables
        self._sessions = session_factory
        self._clock = clock or SystemClock()
        self._queue_probe = queue_probe

    def describe(self) -> Iterator[Metric]:
        # Names only: registering must not touch the database or the broker.
        yield from _families().values()
        yield from _vacuum_families().values()
        yield from _partition_families().values()
        if self._queue_probe is not None:
            yield from _queue_families().values()

    def _collect_queues(self) -> Iterator[Metric]:
        if self._queue_probe is None:
            return
        fam = _queue_families()
        try:
            depths = list(self._queue_probe())
        except Exception:
            log.warning("metrics: cannot read the consumer queues from the broker", exc_info=True)
            fam["up"].add_metric([], 0)
            yield fam["up"]
            return
        fam["up"].add_metric([], 1)
        for d in depths:
            fam["messages"].add_metric([d.queue, d.consumer], d.messages)
            if d.consumers is not None:
                fam["consumers"].add_metric([d.queue, d.consumer], d.consumers)
        yield from fam.values()

    def collect(self) -> Iterator[Metric]:
        fam = _families()
        try:
            with self._sessions() as session:
                st = ops_stats.collect(session, tables=self._tables, clock=self._clock)
        except Exception:
            log.exception("metrics: cannot read the outbox database")
            fam["up"].add_metric([], 0)
            yield fam["up"]
            yield from self._collect_queues()
            return
        fam["up"].add_metric([], 1)
        fam["pending"].add_metric([], st.pending)
        fam["due"].add_metric([], st.due)
        fam["retrying"].add_metric([], st.retrying)
        fam["oldest"].add_metric([], (st.oldest_pending_age_ms or 0) / 1000)
        fam["scheduled"].add_metric([], st.scheduled)
        fam["overdue"].add_metric([], (st.oldest_overdue_ms or 0) / 1000)
        fam["claim_held"].add_metric([], (st.claim_held_ms or 0) / 1000)
        for w in st.waiting_for_worker:
            fam["waiting_for_worker"].add_metric([w.what], w.count)
        fam["published"].add_metric([], st.published)
        for g in st.dead_letters:
            labels = [g.source, g.consumer or ""]
            fam["dead"].add_metric(labels, g.count)
            fam["dead_age"].add_metric(labels, g.oldest_age_ms / 1000)
        for consumer, n in st.inbox.items():
            fam["inbox"].add_metric([consumer], n)
        for consumer, n in st.duplicates_absorbed.items():
            fam["dups"].add_metric([consumer], n)
        for consumer, b in st.batches.items():
            fam["batches"].add_metric([consumer], b["batches"])
            fam["batched"].add_metric([consumer], b["messages"])
        relay = st.counters.get(counters.RELAY, {})
        fam["published_total"].add_metric([], relay.get(counters.PUBLISHED, 0))
        fam["failures_total"].add_metric(["rejected"], relay.get(counters.PUBLISH_FAILURES, 0))
        fam["failures_total"].add_metric(["broker_unavailable"], relay.get(counters.BROKER_UNAVAILABLE, 0))
        fam["dead_total"].add_metric(["outbox", ""], relay.get(counters.DEAD_LETTERED, 0))
        for kind, n in st.reconciled.items():
            if kind != "total":
                fam["reconciled_total"].add_metric([kind], n)
        # scopes starting with '_' are the library's own (the relay, group-run jobs), never a consumer
        consumers = set(st.inbox) | {c for c in st.counters if not c.startswith("_")}
        for consumer in sorted(consumers):
            kept = st.counters.get(consumer, {})
            processed = st.inbox.get(consumer, 0) + kept.get(counters.INBOX_PRUNED, 0)
            fam["processed_total"].add_metric([consumer], processed)
            fam["dead_total"].add_metric(["consumer", consumer], kept.get(counters.DEAD_LETTERED, 0))
        yield from fam.values()
        if st.vacuum is not None:
            yield from _vacuum_metrics(st.vacuum)
        if st.partitions is not None:
            yield from _partition_metrics(st.partitions)
        yield from self._collect_queues()


def make_registry(*, tables: Tables, session_factory: sessionmaker[Session], clock: Clock | None = None,
                  queue_probe: QueueProbe | None = None) -> CollectorRegistry:
    """A fresh registry (never the global default) holding the DB collector (and the broker's queue depths when
    ``queue_probe`` is given)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(OutboxCollector(tables=tables, session_factory=session_factory, clock=clock,
                                      queue_probe=queue_probe))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def start_worker_metrics_server(*, port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` from a background thread; returns the server (``.shutdown()`` stops it), or
    None when the port is taken (a second worker on one host must not crash over metrics)."""
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        log.error("metrics: cannot listen on %s:%s (%s); this worker serves no /metrics", addr, port, e)
        return None
    log.info("metrics: serving /metrics on %s:%s", addr, port)
    return server
