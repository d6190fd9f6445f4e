"""The example Django project. Its Celery app and outbox live in ``shop_project.celery``
(``celery -A shop_project worker`` finds it there)."""
