"""WSGI entry point for gunicorn: ``gunicorn orders.wsgi:app`` (settings from the environment).

A bad configuration exits with one line ``bad configuration: ...`` and status 4, which gunicorn's
master reads as "App failed to load" and stops (it would start workers again for ever otherwise).
"""

from __future__ import annotations

from celery_outbox import exit_on_config_error
from orders.web import create_app

with exit_on_config_error(code=4):
    app = create_app()
