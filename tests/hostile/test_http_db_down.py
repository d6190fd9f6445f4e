"""The Orders app and its admin page with the database down: a JSON (or plain) 503 with a retry hint,
never the database's host, port, user, password or driver text, never an HTML 500."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from celeryconfig import Settings
from relay.web import create_app

PASSWORD = "pw-never-shown"
ORDER = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com",
         "lines": [{"sku": "sku-1", "quantity": 1, "unit_price_cents": 999}]}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def port() -> int:
    return closed_port()


@pytest.fixture
def client(tmp_home: Path, namespace: str, port: int) -> FlaskClient:
    # Given the app pointed at a Postgres URL (user and password included) on a port nobody listens on
    settings = Settings(home=tmp_home, namespace=namespace, broker_url="memory://", admin_token="tok-0123456789abcd",
                        database_url=f"postgresql://orders_user:{PASSWORD}@127.0.0.1:{port}/orders")
    return create_app(settings=settings).test_client()


def assert_no_internals(text: str, port: int) -> None:
    lowered = text.lower()
    for secret in (PASSWORD, "orders_user", "127.0.0.1", str(port), "psycopg", "sqlalchemy", "operationalerror",
                   "connection refused", "traceback"):
        assert secret.lower() not in lowered, text


@pytest.mark.parametrize(("method", "path"), [("GET", "/orders/o-1"), ("POST", "/orders")])
def test_orders_answer_a_generic_json_503(client: FlaskClient, port: int, method: str, path: str) -> None:
    # When a client reads or writes an order
    r = client.open(path, method=method, json=ORDER if method == "POST" else None)
    # Then a JSON 503 that says to retry, with Retry-After, and nothing about the database
    assert r.status_code == 503 and r.mimetype == "application/json"
    assert r.json is not None and "retry" in r.json["error"] and r.json["retry_after_s"] > 0
    assert int(r.headers["Retry-After"]) > 0
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert_no_internals(r.get_data(as_text=True), port)


def test_client_errors_stay_4xx_with_the_database_down(client: FlaskClient, port: int) -> None:
    # When the request is itself bad; Then it is refused before the database is asked: 400, not 503
    for r in (client.post("/orders", json={**ORDER, "currency": "EURO"}),
              client.get("/orders/bad%00id"),
              client.post("/orders", data="[" * 1000 + "]" * 1000, content_type="application/json")):
        assert r.status_code == 400 and r.mimetype == "application/json"
        assert_no_internals(r.get_data(as_text=True), port)


def test_admin_page_answers_503_without_internals(client: FlaskClient, port: int) -> None:
    bearer = {"Authorization": "Bearer tok-0123456789abcd"}
    for path in ("/admin/dead-letters/", "/admin/dead-letters/outbox:1"):
        r = client.get(path, headers=bearer)
        assert r.status_code == 503 and "try again" in r.get_data(as_text=True)
        assert "default-src 'none'" in r.headers["Content-Security-Policy"]
        assert_no_internals(r.get_data(as_text=True), port)


def test_health_and_metrics_still_answer(client: FlaskClient, port: int) -> None:
    assert client.get("/healthz").status_code == 200
    r = client.get("/metrics")
    assert r.status_code == 200
    assert_no_internals(r.get_data(as_text=True), port)
