# Celery's Django layout: the app loads whenever Django starts, so @shared_task binds to it in every process.
from .celery import app as celery_app

__all__ = ("celery_app",)
