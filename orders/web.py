"""The orders HTTP app: POST /orders writes the order and its event in one commit."""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, g, jsonify, request
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Clock, DatabaseError, OutboxError, SystemClock, ValidationError
from celeryconfig import Settings
from orders.models import Order
from orders.service import DuplicateOrderError, parse_order, place_order


def _error(status: int, message: str) -> tuple[Response, int]:
    return jsonify({"error": message}), status


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
                  for li in order.lines],
    }


def create_app(*, settings: Settings | None = None, session_factory: sessionmaker[Session] | None = None,
               clock: Clock | None = None) -> Flask:
    """App factory; tests pass their own session factory and clock."""
    from relay.factory import create_outbox

    settings = settings or Settings.from_env()
    outbox = create_outbox(settings, session_factory=session_factory, clock=clock or SystemClock())
    sessions = outbox.sessions()
    app = Flask("orders")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_message_bytes

    def session() -> Session:
        if "db" not in g:
            g.db = sessions()
        s: Session = g.db
        return s

    @app.teardown_appcontext
    def _close(_exc: BaseException | None) -> None:
        s = g.pop("db", None)
        if s is not None:
            s.close()

    @app.errorhandler(413)
    def _too_large(_e: Exception) -> tuple[Response, int]:
        return _error(413, f"request body is over the limit of {settings.max_message_bytes} bytes")

    @app.post("/orders")
    def create_order() -> tuple[Response, int]:
        if not request.is_json:
            return _error(400, "send the order as JSON with Content-Type: application/json")
        data = request.get_json(silent=True)
        if data is None:
            return _error(400, "request body is not valid JSON")
        try:
            req = parse_order(data)
            order = place_order(session(), req, outbox=outbox,
                                correlation_id=request.headers.get("X-Correlation-Id"))
        except DuplicateOrderError as e:
            return _error(409, str(e))
        except ValidationError as e:
            return _error(400, str(e))
        except DatabaseError as e:
            return _error(503, str(e))
        except OutboxError as e:
            return _error(400, str(e))
        return jsonify(order_json(order)), 201

    @app.get("/orders/<order_id>")
    def get_order(order_id: str) -> tuple[Response, int]:
        order = session().get(Order, order_id)
        if order is None:
            return _error(404, f"order {order_id!r} not found")
        return jsonify(order_json(order)), 200

    @app.get("/healthz")
    def healthz() -> tuple[Response, int]:
        return jsonify({"ok": True}), 200

    from celery_outbox.contrib.flask import init_app as init_ops  # /admin/dead-letters and /metrics

    init_ops(app, outbox)
    return app
