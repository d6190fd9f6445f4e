"""Prometheus metrics.

Two kinds, on purpose:
- ``OutboxCollector`` reads ``ops.stats`` from the database at scrape time. These figures are the same
  from every process (web app, relay, prefork worker children) and survive restarts, so alerts use them.
- ``OutboxCounters`` are ordinary in-process counters the relay and consumers may increment as things
  happen. Under a prefork worker each child has its own, so scrape them from ``-P solo|threads``
  processes (or run prometheus-client in multiprocess mode); the DB-derived families need no such care.

Endpoints: ``GET /metrics`` on the Flask app (``ops.admin.init_app``), and ``start_worker_metrics_server``
which a Celery ``worker_ready`` signal calls in the worker's main process on ``settings.metrics_port``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from ops import stats as ops_stats
from outbox.clock import Clock, SystemClock

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "up": GaugeMetricFamily("outbox_stats_up", "1 if the last scrape could read the outbox database"),
        "pending": GaugeMetricFamily("outbox_pending_messages", "Outbox rows not yet published (excl. dead)"),
        "due": GaugeMetricFamily("outbox_due_messages", "Pending outbox rows whose backoff has passed"),
        "retrying": GaugeMetricFamily("outbox_retrying_messages",
                                      "Pending outbox rows that failed to publish at least once"),
        "oldest": GaugeMetricFamily("outbox_oldest_pending_age_seconds",
                                    "Age of the oldest pending outbox row (0 when none)"),
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
        "counters": CounterMetricFamily("outbox_consumer_counter", "Every consumer counter kept in the database",
                                        labels=["consumer", "name"]),
    }


class OutboxCollector(Collector):
    """Reads the database on every scrape; a failed read yields ``outbox_stats_up 0`` instead of an error."""

    def __init__(self, *, session_factory: sessionmaker[Session], clock: Clock | None = None) -> None:
        self._sessions = session_factory
        self._clock = clock or SystemClock()

    def describe(self) -> Iterator[Metric]:
        # Names only: registering must not touch the database.
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        fam = _families()
        try:
            with self._sessions() as session:
                st = ops_stats.collect(session, clock=self._clock)
        except Exception:
            log.exception("metrics: cannot read the outbox database")
            fam["up"].add_metric([], 0)
            yield fam["up"]
            return
        fam["up"].add_metric([], 1)
        fam["pending"].add_metric([], st.pending)
        fam["due"].add_metric([], st.due)
        fam["retrying"].add_metric([], st.retrying)
        fam["oldest"].add_metric([], (st.oldest_pending_age_ms or 0) / 1000)
        fam["published"].add_metric([], st.published)
        for g in st.dead_letters:
            labels = [g.source, g.consumer or ""]
            fam["dead"].add_metric(labels, g.count)
            fam["dead_age"].add_metric(labels, g.oldest_age_ms / 1000)
        for consumer, n in st.inbox.items():
            fam["inbox"].add_metric([consumer], n)
        for consumer, n in st.duplicates_absorbed.items():
            fam["dups"].add_metric([consumer], n)
        for consumer, values in st.counters.items():
            for name, value in values.items():
                fam["counters"].add_metric([consumer, name], value)
        yield from fam.values()


class OutboxCounters:
    """In-process event counters for the relay and consumers to increment (see the module docstring)."""

    def __init__(self, *, registry: CollectorRegistry) -> None:
        self.published = Counter("outbox_relay_published", "Messages the relay published", registry=registry)
        self.publish_failures = Counter("outbox_relay_publish_failures", "Failed publish attempts",
                                        labelnames=["kind"], registry=registry)
        self.processed = Counter("outbox_consumer_processed", "Deliveries processed (effect committed)",
                                 labelnames=["consumer"], registry=registry)
        self.duplicates = Counter("outbox_consumer_duplicates", "Duplicate deliveries absorbed",
                                  labelnames=["consumer"], registry=registry)
        self.dead_lettered = Counter("outbox_dead_lettered", "Messages dead-lettered",
                                     labelnames=["source", "consumer"], registry=registry)


def make_registry(*, session_factory: sessionmaker[Session], clock: Clock | None = None,
                  with_counters: bool = True) -> tuple[CollectorRegistry, OutboxCounters | None]:
    """A fresh registry (never the global default) holding the DB collector and, optionally, counters."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(OutboxCollector(session_factory=session_factory, clock=clock))
    counters = OutboxCounters(registry=registry) if with_counters else None
    return registry, counters


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
