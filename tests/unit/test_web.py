"""The Flask app: valid orders are written with their event; bad input is a 400 and writes nothing."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.schema import Tables
from celeryconfig import Settings
from orders.models import Order
from relay.web import create_app

ORDER = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com",
         "lines": [{"sku": "sku-1", "quantity": 1, "unit_price_cents": 999}]}


@pytest.fixture
def client(settings: Settings, sqlite_sessions: sessionmaker[Session], clock: ManualClock) -> FlaskClient:
    app = create_app(settings=settings.replace(max_message_bytes=4096), session_factory=sqlite_sessions,
                     clock=clock)
    return app.test_client()


def rows(sessions: sessionmaker[Session], tables: Tables) -> tuple[int, int]:
    """(orders, outbox rows): an order writes two rows, its OrderPlaced event and its confirmation e-mail task."""
    with sessions() as s:
        return (int(s.scalar(sa.select(sa.func.count()).select_from(Order)) or 0),
                int(s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) or 0))


def test_post_then_get(client: FlaskClient, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    r = client.post("/orders", json=ORDER)
    assert r.status_code == 201, r.json
    assert r.json is not None and r.json["total_cents"] == 999
    g = client.get("/orders/o-1")
    assert g.status_code == 200 and g.json is not None and g.json["lines"][0]["sku"] == "sku-1"
    assert rows(sqlite_sessions, tables) == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "status", "match"),
    [
        ({"data": "{not json", "content_type": "application/json"}, 400, "not valid JSON"),
        ({"data": "order_id=1", "content_type": "application/x-www-form-urlencoded"}, 400, "Content-Type"),
        ({"json": {**ORDER, "email": "nope"}}, 400, "email"),
        ({"json": {**ORDER, "lines": "x"}}, 400, "lines"),
        ({"json": [1, 2]}, 400, "JSON object"),
        ({"data": json.dumps({**ORDER, "customer_id": "c" * 10}) + " " * 5000,
          "content_type": "application/json"}, 413, "over the limit"),
    ],
)
def test_bad_input_is_rejected_and_writes_nothing(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                                  tables: Tables, kwargs: dict[str, object], status: int,
                                                  match: str) -> None:
    r = client.post("/orders", **kwargs)
    assert r.status_code == status
    assert r.json is not None and match in r.json["error"]
    assert rows(sqlite_sessions, tables) == (0, 0)


def test_duplicate_order_is_409_and_keeps_one_event(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                                     tables: Tables) -> None:
    assert client.post("/orders", json=ORDER).status_code == 201
    r = client.post("/orders", json=ORDER)
    assert r.status_code == 409 and r.json is not None and "already exists" in r.json["error"]
    assert rows(sqlite_sessions, tables) == (1, 2)


def test_unknown_order_is_404(client: FlaskClient) -> None:
    assert client.get("/orders/missing").status_code == 404
