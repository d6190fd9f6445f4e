"""The example Django project. Importing it loads the Celery app, the Django way."""

from __future__ import annotations

from shop_project.celery import app as celery_app

__all__ = ["celery_app"]
