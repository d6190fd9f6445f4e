# The adopting team's settings: its SQLite database (a file named by SHOP_DB_PATH), its orders app.
import os

SECRET_KEY = "django-insecure-adoption-test-only"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = ["orders", "celery_outbox.contrib.django"]  # the outbox_* tables: manage.py migrate
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "proj.urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["SHOP_DB_PATH"],
                         "TEST": {"NAME": os.environ["SHOP_DB_PATH"] + "-test"}}}  # a file: the relay shares it
DATABASES["default"]["ATOMIC_REQUESTS"] = True  # each view one transaction: its .delay() a row of it
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True

CELERY_BROKER_URL = os.environ["SHOP_BROKER_URL"]  # read by app.config_from_object(..., namespace="CELERY")
OUTBOX_NAMESPACE = os.environ.get("SHOP_NAMESPACE", "shop")  # queue prefix: the consumer's queue is <ns>.notify
# the tests run several copies of this project on one shared broker: each its own queue for plain tasks
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("SHOP_TASK_QUEUE", "celery")
