# `celery -A proj worker` and `manage.py outbox ...` find the Celery app and the outbox here.
import os

from celery import Celery

from celery_outbox.contrib.django import DjangoOutbox

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # orders/tasks.py: @shared_task
outbox = DjangoOutbox(app)  # settings.py's OUTBOX_*; Django's database (the test database in tests)
