"""The chaos run's Celery app: the real one, with a short Redis visibility timeout.

On Redis a message delivered to a worker that is then SIGKILLed whole (solo or threads pool) stays in the
``unacked`` hash until ``visibility_timeout`` passes (3600 s in production): that is an hour before
redelivery. A chaos run kills workers on purpose, so it shortens the timeout
(``OUTBOX_CHAOS_VISIBILITY_TIMEOUT_S``) to watch the redelivery happen; the inbox absorbs the early
duplicates a short timeout can cause. It also shortens ``unacked_mutex_expire`` (300 s by default):
kombu's restore of unacked messages takes a mutex in Redis, and a worker SIGKILLed while holding it
blocks every restore, for every worker, until the mutex expires (seen in a chaos run: 5 messages
stuck in ``unacked`` behind a dead worker's mutex). RabbitMQ requeues on connection loss and needs
none of it.
"""

from __future__ import annotations

import os

from outbox.celery_app import create_celery_app

app = create_celery_app()
_vt = int(os.environ.get("OUTBOX_CHAOS_VISIBILITY_TIMEOUT_S", "0") or 0)
if _vt > 0:
    app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}), "visibility_timeout": _vt,
                                         "unacked_restore_interval": max(1, _vt // 3),
                                         "unacked_mutex_expire": max(5, _vt * 2)}
