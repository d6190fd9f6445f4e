"""WSGI entry point for gunicorn: ``gunicorn orders.wsgi:app`` (settings from the environment)."""

from __future__ import annotations

from orders.web import create_app

app = create_app()
