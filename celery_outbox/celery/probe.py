"""The broker half of the readiness check: open a kombu connection to the broker and close it.

``celery_outbox.ops.health.readiness`` takes the callable ``broker_probe`` returns, so the core never
imports kombu. One attempt per failover URL, no sleeping between them, bounded by ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kombu import Connection

from celery_outbox.celery.config import require_broker_client, sentinel_options
from celery_outbox.config.declare import broker_kind
from celery_outbox.ops.health import BrokerProbe
from celery_outbox.settings import Settings

DEFAULT_TIMEOUT_S = 2.0  # under the 3 s a container healthcheck typically allows


@contextmanager
def connected(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              transport_options: Mapping[str, Any] | None = None) -> Iterator[Connection]:
    """A kombu connection to the broker at ``url``, connected within ``timeout_s`` (one attempt per failover
    URL, no sleeping), released on exit; raises when it cannot connect. ``transport_options``: what the
    URL cannot say (a ``sentinel://`` broker's ``master_name``: ``config.sentinel_options``)."""
    require_broker_client(url)
    options: dict[str, Any] = {}
    if broker_kind(url) == "redis":  # sentinel:// included
        options.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    options.update(transport_options or {})
    conn = Connection(url, connect_timeout=timeout_s, transport_options=options)
    try:
        # Virtual transports (Redis) open a channel to connect, and the Redis channel PINGs the server.
        conn.ensure_connection(max_retries=url.count(";"), interval_start=0, interval_step=0, interval_max=0,
                               timeout=timeout_s)
        yield conn
    finally:
        conn.release()


def ping_broker(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                transport_options: Mapping[str, Any] | None = None) -> None:
    """Return when the broker at ``url`` accepts a connection (Redis: answers PING); raise otherwise."""
    with connected(url, timeout_s=timeout_s, transport_options=transport_options):
        pass


def broker_probe(url: str | Callable[[], str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 settings: Settings | None = None) -> BrokerProbe:
    """A probe for ``health.readiness``; ``url`` may be a callable (``outbox.broker_url``), asked at each
    probe, so a missing broker setting is a failed check, not a crash at start-up. ``settings``: where a
    ``sentinel://`` broker's master name comes from."""

    def probe() -> None:
        found = url() if callable(url) else url
        options = sentinel_options(settings, found) if settings is not None else {}
        ping_broker(found, timeout_s=timeout_s, transport_options=options)

    return probe
