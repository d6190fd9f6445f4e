"""The Orders endpoint without the outbox, for bench/pipeline.py: ``gunicorn bench._plain_web:app``.

``POST /orders`` does what ``orders/web.py`` does (decode, validate, write the order and its lines in one
commit, answer 201 with the order) minus the outbox row; after the commit it sends one plain task per
consumer the deployment routes ``OrderPlaced`` to and one plain confirmation e-mail task, through the
same provider (``bench._worker``: the same effects, on the same queues, no inbox). The baseline an
application without the outbox would run.
"""

from __future__ import annotations

import functools
from typing import Any

from flask import Flask, Response, jsonify, request

from bench._worker import place_plain_order, plain_celery, send_plain
from celery_outbox import ValidationError
from celery_outbox.clock import SystemClock
from celeryconfig import Settings
from orders.models import Order
from orders.service import ORDER_PLACED, parse_order
from orders.web import decode_json, order_json


def create_app() -> Flask:
    from relay.factory import create_outbox

    settings = Settings.from_env()
    outbox = create_outbox(settings)  # only to read the deployment's routes and its database sessions
    consumers = outbox.routes()[ORDER_PLACED]
    sessions = outbox.sessions()
    celery = plain_celery(outbox.settings)
    clock = SystemClock()
    app = Flask("plain-orders")

    @app.post("/orders")
    def create_order() -> tuple[Response, int]:
        try:
            req = parse_order(decode_json(request.get_data(cache=False), max_depth=settings.max_json_depth))
        except ValidationError as e:
            return jsonify({"error": str(e)}), 400
        now = clock.now_ms()
        with sessions() as s:
            place_plain_order(s, req, now_ms=now)
            body = order_json(s.get_one(Order, req.order_id))
        send_plain(celery, outbox.settings, consumers, req, now_ms=now)
        return jsonify(body), 201

    @app.get("/healthz")
    def healthz() -> tuple[Response, int]:
        return jsonify({"ok": True}), 200

    return app


@functools.cache
def _app() -> Flask:
    return create_app()


def __getattr__(name: str) -> Any:
    """``gunicorn bench._plain_web:app`` looks up ``app``: built on first access, not at import."""
    if name == "app":
        return _app()
    raise AttributeError(name)
