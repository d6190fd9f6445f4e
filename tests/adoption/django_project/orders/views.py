import json

from django.http import JsonResponse

from celery_outbox import Event
from celery_outbox.contrib.django import publish
from orders.models import Order
from orders.tasks import confirm


def place(request):  # ATOMIC_REQUESTS: the order, its event and its task commit together, or none of them
    body = json.loads(request.body)
    Order.objects.create(id=body["id"])
    publish(Event("OrderPlaced", {"order_id": body["id"]}))  # a row of the same transaction
    confirm.delay(body["id"])  # a @shared_task: an outbox row of this request's transaction
    if body.get("fail"):
        raise RuntimeError("payment declined")  # a 500: the whole request rolls back
    return JsonResponse({"ok": True}, status=201)
