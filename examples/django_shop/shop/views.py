"""The shop's JSON views: the same contract as the Flask app's POST /orders and GET /orders/<id>."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from shop_project.celery import outbox

from celery_outbox.errors import DatabaseError, OutboxError, ValidationError
from orders.service import DuplicateOrderError, parse_order
from shop import services
from shop.models import Order


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


def order_json(order: Order) -> dict[str, Any]:
    return {
        "order_id": order.id,
        "customer_id": order.customer_id,
        "email": order.email,
        "currency": order.currency,
        "total_cents": order.total_cents,
        "status": order.status,
        "created_at_ms": order.created_at_ms,
        "lines": [{"sku": li.sku, "quantity": li.quantity, "unit_price_cents": li.unit_price_cents}
                  for li in order.lines.all()],
    }


@csrf_exempt  # type: ignore[untyped-decorator]
@require_POST  # type: ignore[untyped-decorator]
def create_order(request: HttpRequest) -> JsonResponse:
    """Place the order and stage its OrderPlaced event in one transaction (never one without the other)."""
    try:
        data = json.loads(request.body)
    except ValueError:
        return _error(400, "request body is not valid JSON")
    try:
        req = parse_order(data)
        order = services.place_order(req, clock=outbox.clock, max_message_bytes=outbox.settings.max_message_bytes,
                                     known_types=outbox.routes(),
                                     correlation_id=request.headers.get("X-Correlation-Id"))
    except DuplicateOrderError as e:
        return _error(409, str(e))
    except ValidationError as e:
        return _error(400, str(e))
    except DatabaseError as e:
        return _error(503, str(e))
    except OutboxError as e:
        return _error(400, str(e))
    return JsonResponse(order_json(order), status=201)


@require_GET  # type: ignore[untyped-decorator]
def get_order(request: HttpRequest, order_id: str) -> JsonResponse:
    order = Order.objects.filter(pk=order_id).first()
    if order is None:
        return _error(404, f"order {order_id!r} not found")
    return JsonResponse(order_json(order))
