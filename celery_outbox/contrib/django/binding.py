"""No silent bypass: in a Django process that never built the project's ``Outbox``, a task sent through
Celery's default app is refused, never sent to Celery's default broker outside the transaction.

``@shared_task`` tasks run on Celery's *current* app, and a process that never imported ``proj/celery.py``
(the web process of a project whose ``proj/__init__.py`` does not import it) has none: Celery then makes a
fallback app of its own with its default broker, and ``.delay()`` would publish there at once, outside the
view's transaction, with no error. When Django finishes loading the ``celery_outbox.contrib.django`` app
(``OutboxDjangoConfig.ready``), the fallback becomes an app whose every send raises ``ConfigError`` with
the fix. ``DjangoOutbox(app)`` makes the project's app the default (``app.set_default()``), so a bound
process never meets it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery import _state as celery_state

from celery_outbox.errors import ConfigError

UNBOUND_MAIN = "celery_outbox.unbound"
_CELERY_FALLBACK_MAIN = "default"  # the name Celery gives the fallback app it creates on demand


class Refuse:
    """``amqp.send_task_message`` of the unbound app: raises before any broker connection is opened."""

    def __call__(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        raise ConfigError(
            f"task {name!r} was sent through Celery's default app: this process never built the project's "
            "Outbox, so the task would go straight to a default broker, outside your transaction. Import your "
            "Celery app where Django starts (proj/__init__.py: `from .celery import app as celery_app`, with "
            "`outbox = DjangoOutbox(app)` in proj/celery.py); nothing was sent")


def unbound_app() -> Celery:
    app = Celery(UNBOUND_MAIN, set_as_current=False, fixups=[])
    app.amqp.send_task_message = Refuse()  # an instance attribute over Celery's cached property
    return app


def refuse_unbound_sends() -> None:
    """Make Celery's default app one that refuses every send, unless a real app is the default already."""
    default = celery_state.default_app
    if default is None or default.main == _CELERY_FALLBACK_MAIN:
        celery_state.set_default_app(unbound_app())
