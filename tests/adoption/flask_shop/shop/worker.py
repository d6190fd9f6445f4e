# `celery -A shop.worker worker` and `outbox -A shop.worker relay` find the app and the outbox here.
import os

from shop.app import create

web, outbox = create(os.environ["SHOP_DATABASE_URL"], os.environ["SHOP_BROKER_URL"], os.environ["SHOP_NAMESPACE"])
app = outbox.app
