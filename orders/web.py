"""The orders HTTP app: POST /orders writes the order and its event in one commit.

Hostile input never reaches the database and never gets a 5xx: the body is decoded here with a depth
bound (``Settings.max_json_depth``), no NaN/Infinity and no duplicate keys, then validated to what the
columns hold (``orders.service.parse_order``). Every answer is JSON; every client error is a 4xx; a
database that is down is a 503 with a generic message and ``Retry-After``, never its host, port or SQL.

Retrying a POST safely: send an ``Idempotency-Key`` header (1-64 of ``A-Z a-z 0-9 _ . : -``, a UUID
fits). It becomes the order's id; a retry with the same key and the same body answers the original
``201`` and order (header ``Idempotent-Replayed: true``) and writes nothing; the same key with another
body is a ``422``. Without the header, a client-chosen ``order_id`` that already exists is a ``409``.
"""

from __future__ import annotations

import json
import logging
import re
from itertools import accumulate
from typing import Any

from flask import Flask, Response, g, jsonify, request
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as WerkzeugResponse

from celery_outbox import (
    DatabaseError,
    MessageTooLargeError,
    Outbox,
    OutboxError,
    ValidationError,
)
from celery_outbox.contrib.flask import security_headers
from orders.models import Order
from orders.service import DuplicateOrderError, check_id, parse_order, place_or_replay, place_order

log = logging.getLogger("orders.web")

API_CSP = "default-src 'none'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_AFTER_S = 5
_CORRELATION = re.compile(r"\A[\x21-\x7e]{1,128}\Z", re.ASCII)  # printable ASCII, no spaces
# A JSON string, exactly as the decoder lexes one (only strings can hide brackets).
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


class BadRequestBody(ValidationError):
    """The body is not JSON this service accepts (encoding, syntax, depth, constants, duplicate keys)."""


def json_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of ``text`` outside strings, without recursing (exact for valid
    JSON; for invalid JSON the decoder fails before it could recurse deeper than this)."""
    bare = _JSON_STRING.sub("", text)
    steps = (1 if c in "[{" else -1 for c in _BRACKETS.findall(bare))
    return max(accumulate(steps, initial=0))


def _no_constants(name: str) -> Any:
    raise BadRequestBody(f"{name} is not a JSON number")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise BadRequestBody("request body has a duplicate key in one object")
    return out


def decode_json(raw: bytes, *, max_depth: int) -> Any:
    """Strict, depth-bounded JSON: UTF-8 only, at most ``max_depth`` nested arrays/objects, no
    NaN/Infinity, no duplicate keys. Every failure is a ``BadRequestBody`` (a 400), never a crash."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequestBody("request body is not valid JSON (not UTF-8)") from None
    if json_depth(text) > max_depth:
        raise BadRequestBody(f"request body is nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicate_keys)
    except BadRequestBody:
        raise
    except (ValueError, RecursionError):  # syntax, a number too long to convert
        raise BadRequestBody("request body is not valid JSON") from None


def _error(status: int, message: str, **extra: Any) -> tuple[Response, int]:
    return jsonify({"error": message, **extra}), status


def _unavailable() -> tuple[Response, int]:
    resp, status = _error(503, "the database is unavailable; retry later", retry_after_s=RETRY_AFTER_S)
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp, status


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


def create_app(*, outbox: Outbox) -> Flask:
    """The Orders HTTP app writing through ``outbox``: this deployment's is built by ``relay.web.create_app``
    (relay/ composes the deployment; the Orders service stands below it and is handed what it writes to)."""
    settings = outbox.settings
    sessions = outbox.sessions()
    app = Flask("orders")
    app.url_map.merge_slashes = False  # '/orders//x' is a JSON 404, not an HTML redirect
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

    @app.after_request
    def _headers(resp: Response) -> Response:
        security_headers(resp, csp=API_CSP)  # the admin blueprint has set its own policy already
        return resp

    @app.errorhandler(413)
    def _too_large(_e: Exception) -> tuple[Response, int]:
        return _error(413, f"request body is over the limit of {settings.max_message_bytes} bytes")

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException) -> WerkzeugResponse:
        """404, 405, ... as JSON; werkzeug's own headers (``Allow``) are kept."""
        resp = e.get_response()
        resp.set_data(json.dumps({"error": (e.name or "error").lower()}))
        resp.content_type = "application/json"
        return resp

    @app.errorhandler(DatabaseError)
    @app.errorhandler(sa_exc.SQLAlchemyError)
    def _database_error(_e: Exception) -> tuple[Response, int]:
        log.warning("database error answering %s %s", request.method, request.path, exc_info=True)
        return _unavailable()

    @app.errorhandler(Exception)
    def _internal_error(_e: Exception) -> tuple[Response, int]:
        log.error("unhandled error answering %s %s", request.method, request.path, exc_info=True)
        return _error(500, "internal error; it was logged")

    @app.post("/orders")
    def create_order() -> tuple[Response, int]:
        if not request.is_json:
            return _error(400, "send the order as JSON with Content-Type: application/json")
        key = request.headers.get(IDEMPOTENCY_HEADER)
        correlation_id = request.headers.get("X-Correlation-Id")
        try:
            if correlation_id is not None and not _CORRELATION.match(correlation_id):
                raise ValidationError("X-Correlation-Id must be 1-128 printable ASCII characters without spaces")
            data = decode_json(request.get_data(cache=False), max_depth=settings.max_json_depth)
            req = parse_order(data, idempotency_key=key)
            if key is None:
                order, created = place_order(session(), req, outbox=outbox, correlation_id=correlation_id), True
            else:
                order, created = place_or_replay(session(), req, outbox=outbox, correlation_id=correlation_id)
        except DuplicateOrderError as e:
            if key is not None:
                return _error(422, f"{IDEMPOTENCY_HEADER} {key!r} was already used for a different order")
            return _error(409, str(e))
        except MessageTooLargeError:
            return _error(413, f"the order's event is over the limit of {settings.max_message_bytes} bytes")
        except ValidationError as e:
            return _error(400, str(e))
        except DatabaseError:
            raise  # 503 from the handler, without the database's text
        except OutboxError as e:
            return _error(400, str(e))
        resp = jsonify(order_json(order))
        if not created:
            resp.headers["Idempotent-Replayed"] = "true"
        return resp, 201

    @app.get("/orders/<order_id>")
    def get_order(order_id: str) -> tuple[Response, int]:
        try:
            check_id(order_id, "an order id")
        except ValidationError as e:
            return _error(400, str(e))
        order = session().get(Order, order_id)
        if order is None:
            return _error(404, f"order {order_id!r} not found")
        return jsonify(order_json(order)), 200

    @app.get("/healthz")
    def healthz() -> tuple[Response, int]:
        """Liveness: this process answers HTTP. It asks no dependency on purpose: a database or broker
        outage must not make the orchestrator restart every web process; readiness (``/readyz``) says
        whether to send traffic here."""
        return jsonify({"ok": True, "status": "alive"}), 200

    # /admin/dead-letters, /metrics and /readyz (readiness: database, schema revision, broker)
    from celery_outbox.contrib.flask import init_app as init_ops

    init_ops(app, outbox)
    return app
