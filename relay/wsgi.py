"""WSGI entry point for gunicorn: ``gunicorn relay.wsgi:app`` (settings from the environment).

A bad configuration exits with one line ``bad configuration: ...``: status 4 under gunicorn, which its
master reads as "App failed to load" and stops (it would start workers again for ever otherwise), and
status 2 anywhere else (``python -c 'import relay.wsgi'``, another WSGI server), like the ``outbox`` CLI.
"""

from __future__ import annotations

import sys

from celery_outbox import exit_on_config_error
from relay.web import create_app

with exit_on_config_error(code=4 if "gunicorn" in sys.modules else 2):
    app = create_app()
