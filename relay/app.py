"""The reference deployment's Celery app: ``celery -A relay.app worker|beat`` and ``outbox -A relay.app relay``.

Built only on ``celery_outbox``'s public API from this deployment's settings (celeryconfig.py). The
embedded Redis is never started here: the demo (or ``python -m devtools embedded-redis start``) starts
it, and this module finds it through its port file.
"""

from __future__ import annotations

from relay.factory import create_celery_app, create_outbox

outbox = create_outbox()
app = outbox.app

__all__ = ["app", "create_celery_app", "create_outbox", "outbox"]
