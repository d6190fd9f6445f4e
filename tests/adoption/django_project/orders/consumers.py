from celery_outbox.contrib.django import idempotent_consumer
from orders.models import Notification


@idempotent_consumer("OrderPlaced", name="notify")  # effect + inbox row in ONE transaction.atomic()
def notify(envelope):
    Notification.objects.create(order_id=envelope.payload["order_id"])
