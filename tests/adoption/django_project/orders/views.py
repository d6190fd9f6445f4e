import json

from django.db import transaction
from django.http import JsonResponse

from celery_outbox import Event
from celery_outbox.contrib.django import publish
from orders.models import Order


def place(request):
    order_id = json.loads(request.body)["id"]
    with transaction.atomic():  # the order and its event: one commit
        Order.objects.create(id=order_id)
        publish(Event("OrderPlaced", {"order_id": order_id}))
    return JsonResponse({"ok": True}, status=201)
