"""``Settings.tracer_provider`` (``OUTBOX_TRACER_PROVIDER=module:function``): one hook that gives every
process running outbox work its OpenTelemetry tracer provider.

The ``Outbox`` calls ``install`` where it is built: a web process, ``outbox relay``, ``celery beat``
and the main process of ``celery worker`` (which loads your ``-A`` module). A prefork pool process
inherits that provider (the SDK's batch span processor starts its thread again after the fork); a pool
process whose parent has none (the app loaded lazily) builds it on ``worker_process_init``. A provider
set before (by you, or by ``opentelemetry-instrument``) is kept. A hook that cannot be imported is a
``ConfigError`` at start; one that raises leaves tracing off in that process, logged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from celery import signals

from celery_outbox import tracing
from celery_outbox.errors import ConfigError


def load(spec: str) -> Callable[[], Any]:
    """``module:function`` -> the function (imported now, so a typo fails at start, not in a pool process)."""
    module_name, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as e:
        raise ConfigError(f"OUTBOX_TRACER_PROVIDER={spec!r}: cannot import {e.name or module_name!r}") from None
    if not callable(found):
        raise ConfigError(f"OUTBOX_TRACER_PROVIDER={spec!r}: {attr!r} is not a function of {module_name!r}")
    factory: Callable[[], Any] = found
    return factory


def install(outbox: Any) -> None:
    """Install the settings' tracer provider here and in each worker pool process of ``outbox.app``."""
    spec = outbox.settings.tracer_provider
    if not spec:
        return
    factory = load(spec)
    tracing.install_tracer_provider(factory)

    def in_pool_process(**kwargs: Any) -> None:
        tracing.install_tracer_provider(factory)

    outbox._tracer_hook = in_pool_process  # the signal holds it weakly: it lives as long as the outbox
    signals.worker_process_init.connect(in_pool_process)
