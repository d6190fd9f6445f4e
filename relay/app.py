"""The reference deployment's Celery app: ``celery -A relay.app worker|beat`` and ``outbox -A relay.app relay``.

Built only on ``celery_outbox``'s public API from this deployment's settings (celeryconfig.py). The
embedded Redis is never started here: the demo (or ``python -m devtools embedded-redis start``) starts
it, and this app finds it through its port file when the broker is first needed (database commands of
``outbox`` never need it). A bad configuration (``OUTBOX_*``, routes naming
an unknown consumer) exits here with one line ``bad configuration: ...`` and status 2, no traceback.
"""

from __future__ import annotations

from celery_outbox import exit_on_config_error
from relay.factory import create_celery_app, create_outbox

with exit_on_config_error():
    # An embedded broker that is not running yet is looked for when the broker is needed (a worker's or
    # beat's start, the relay, `outbox check`), so `outbox db upgrade` and the other database commands
    # run without it (relay/factory.py, EmbeddedOnDemandOutbox).
    outbox = create_outbox(broker_on_demand=True)
    outbox.check()
app = outbox.app

__all__ = ["app", "create_celery_app", "create_outbox", "outbox"]
