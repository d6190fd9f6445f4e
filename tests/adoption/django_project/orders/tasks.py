from celery import shared_task

from orders.models import Notification


@shared_task(name="orders.confirm")
def confirm(order_id):
    Notification.objects.create(order_id=f"confirmed:{order_id}")
