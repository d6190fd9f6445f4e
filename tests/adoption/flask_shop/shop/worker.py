# `celery -A shop.worker worker` and `outbox -A shop.worker relay` find the app and the outbox here.
from shop.app import create_app

web = create_app()
app = web.extensions["celery"]
outbox = web.extensions["celery_outbox"]
