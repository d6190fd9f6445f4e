"""Hostile HTTP input to the Orders app: never a 5xx, always JSON, nothing of the database in the answer.

Hypothesis drives POST /orders (raw bytes, arbitrary JSON, order-shaped bodies with hostile values,
hostile headers) and GET /orders/<id>; fixed cases pin each class named in the issue (NUL, lone
surrogates, deep nesting, values past the columns, ``$``-style trailing newlines, falsy ids) on SQLite
and on real Postgres, where an unvalidated value would reach the database and fail there.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker
from werkzeug.test import TestResponse

from celery_outbox.clock import ManualClock
from celery_outbox.contrib.flask import CSRF_COOKIE
from celery_outbox.schema import Tables
from celeryconfig import Settings
from orders import web
from orders.models import Order
from orders.service import OrderRequest
from orders.web import json_depth
from relay.web import create_app
from tests.ops_seed import T0, consumer_dead_letter, outbox_row

ORDER: dict[str, Any] = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com", "currency": "EUR",
                         "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 999}]}
# Text that must never appear in an answer unless the client sent it: driver, SQL, traces, hosts.
FORBIDDEN = ("sqlalchemy", "psycopg", "sqlite", "traceback", "operationalerror", "dataerror", "integrityerror",
             "127.0.0.1", "localhost", ":5432", "select ", "insert into", "varchar")
FUZZ = hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def make_client(settings: Settings, sessions: sessionmaker[Session], clock: ManualClock) -> FlaskClient:
    app = create_app(settings=settings.replace(max_message_bytes=64 * 1024, admin_token="t0ken-0123456789ab"),
                     session_factory=sessions, clock=clock)
    return app.test_client()


@pytest.fixture
def client(settings: Settings, sqlite_sessions: sessionmaker[Session], clock: ManualClock) -> FlaskClient:
    return make_client(settings, sqlite_sessions, clock)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, settings: Settings, clock: ManualClock) -> Iterator[tuple[FlaskClient, Any]]:
    """(client, sessions) on SQLite and on real Postgres (which enforces lengths and integer ranges)."""
    if request.param == "sqlite":
        sessions: sessionmaker[Session] = request.getfixturevalue("sqlite_sessions")
        yield make_client(settings, sessions, clock), sessions
    else:
        url: str = request.getfixturevalue("pg_url")
        sessions = request.getfixturevalue("pg_sessions")
        yield make_client(settings.replace(database_url=url), sessions, clock), sessions


def counts(sessions: sessionmaker[Session], tables: Tables) -> tuple[int, int]:
    """(orders, outbox rows): an order writes two rows, its OrderPlaced event and its confirmation e-mail task."""
    with sessions() as s:
        return (int(s.scalar(sa.select(sa.func.count()).select_from(Order)) or 0),
                int(s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) or 0))


def assert_clean(r: TestResponse, *, sent: str = "") -> dict[str, Any]:
    """Not a 5xx, a JSON object with the security headers, and nothing of the server's internals."""
    assert r.status_code < 500, (r.status_code, r.get_data(as_text=True))
    assert r.mimetype == "application/json", r.get_data(as_text=True)[:300]
    body = json.loads(r.get_data(as_text=True))
    assert isinstance(body, dict)
    if r.status_code >= 400:
        assert isinstance(body.get("error"), str) and body["error"]
    text = r.get_data(as_text=True).lower()
    leaked = [t for t in FORBIDDEN if t in text and t not in sent.lower()]
    assert leaked == [], text
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    return body


# -- strategies -------------------------------------------------------------------------------------

HOSTILE_STRINGS = st.sampled_from([
    "", " ", "\x00", "o\x00", "\ud800", "a\udfff", "EUR\n", "o-1\n", "a@example.com\n", "x" * 65, "y" * 321,
    "ABCD", "eur", "\u0661", "\u00b2", "\u2460", "é", "a@b", "@.", "a@b.c\r", "0", "null", "NaN", "../x", "%00",
])
TEXT = st.one_of(HOSTILE_STRINGS, st.text(max_size=80),
                 st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3))
INTS = st.one_of(st.integers(min_value=-(10**30), max_value=10**30),
                 st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**100]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=4),
                                                        st.dictionaries(TEXT, c, max_size=4)), max_leaves=20)
LINE = st.fixed_dictionaries({}, optional={"sku": st.one_of(TEXT, JSON_VALUES), "quantity": st.one_of(INTS, SCALARS),
                                           "unit_price_cents": st.one_of(INTS, SCALARS)})
ORDER_SHAPED = st.fixed_dictionaries({}, optional={
    "order_id": st.one_of(TEXT, SCALARS, st.just([]), st.just({})),
    "customer_id": st.one_of(TEXT, SCALARS), "email": st.one_of(TEXT, SCALARS), "currency": st.one_of(TEXT, SCALARS),
    "lines": st.one_of(st.lists(st.one_of(LINE, JSON_VALUES), max_size=3), SCALARS),
})


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _deep(n: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * n + close * n).encode()


RAW_BODIES = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    JSON_VALUES.map(_dumps),
    ORDER_SHAPED.map(_dumps),
    st.integers(min_value=65, max_value=200_000).map(_deep),
    st.integers(min_value=65, max_value=50_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.sampled_from([b"NaN", b"[Infinity]", b'{"order_id":"a","order_id":"b"}', b"1" * 5000, b"\xef\xbb\xbf{}",
                     b'"\\ud800"', b'{"lines":[' * 40 + b"]" * 40, b"[" * 100_000]),
)
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=80)
HEADERS = st.fixed_dictionaries({}, optional={
    "Idempotency-Key": st.one_of(HEADER_TEXT, st.sampled_from(["", "k-1", "o-1", "x" * 65, "\u0661"])),
    "X-Correlation-Id": st.one_of(HEADER_TEXT, st.sampled_from(["", "c" * 129, "ok-id"])),
})
CONTENT_TYPES = st.sampled_from(["application/json", "application/json; charset=utf-8", "application/merge-patch+json",
                                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])


# -- properties -------------------------------------------------------------------------------------

@FUZZ
@given(body=RAW_BODIES, headers=HEADERS, content_type=CONTENT_TYPES)
def test_any_post_body_is_a_clean_answer(client: FlaskClient, body: bytes, headers: dict[str, str],
                                         content_type: str) -> None:
    # Given any bytes, headers and content type; When they are POSTed; Then a clean non-5xx JSON answer
    r = client.post("/orders", data=body, headers=headers, content_type=content_type)
    assert_clean(r, sent=body.decode("utf-8", "replace") + repr(headers))


@FUZZ
@given(order=ORDER_SHAPED, headers=HEADERS)
def test_order_shaped_bodies_are_validated_before_the_database(client: FlaskClient, order: dict[str, Any],
                                                               headers: dict[str, str]) -> None:
    # Given an order-shaped body whose fields hold hostile values; When it is POSTed
    r = client.post("/orders", data=_dumps(order), headers=headers, content_type="application/json")
    # Then the answer is clean; and a created order holds exactly what the columns can store
    body = assert_clean(r, sent=json.dumps(order) + repr(headers))
    if r.status_code == 201:
        assert len(body["order_id"]) <= 64 and len(body["customer_id"]) <= 64 and len(body["email"]) <= 320
        assert len(body["currency"]) == 3 and 0 <= body["total_cents"] < 2**63
        assert all(1 <= li["quantity"] < 2**31 and 0 <= li["unit_price_cents"] < 2**63 for li in body["lines"])


@FUZZ
@given(order_id=st.one_of(TEXT, st.text(min_size=1, max_size=70)))
def test_any_get_id_is_a_clean_answer(client: FlaskClient, order_id: str) -> None:
    # Given any id text (NUL, surrogates, slashes, unicode digits); When it is fetched; Then 400/404, never 5xx
    path = "/orders/" + urllib.parse.quote(order_id.encode("utf-8", "surrogatepass"), safe="")
    r = client.get(path)
    assert_clean(r, sent=order_id)
    assert r.status_code in (200, 400, 404)


def test_the_depth_scan_ignores_brackets_inside_strings() -> None:
    assert json_depth('{"a": "[[[[[[", "b": [1, {"c": "\\"]]]"}]}') == 3
    assert json_depth("[" * 70 + "]" * 70) == 70
    assert json_depth('"' + "[" * 100 + '"') == 0


# -- fixed cases, SQLite and Postgres --------------------------------------------------------------

BAD_BODIES = [
    pytest.param({**ORDER, "customer_id": "c\x00"}, "customer_id", id="nul-customer"),
    pytest.param({**ORDER, "email": "a\x00@example.com"}, "email", id="nul-email"),
    pytest.param({**ORDER, "email": "a\ud800@example.com"}, "email", id="surrogate-email"),
    pytest.param({**ORDER, "email": "a" * 310 + "@example.com"}, "email", id="email-over-320"),
    pytest.param({**ORDER, "email": "a@example.com\n"}, "email", id="email-trailing-newline"),
    pytest.param({**ORDER, "currency": "EURO"}, "currency", id="long-currency"),
    pytest.param({**ORDER, "currency": "EUR\n"}, "currency", id="currency-trailing-newline"),
    pytest.param({**ORDER, "order_id": "o-1\n"}, "order_id", id="id-trailing-newline"),
    pytest.param({**ORDER, "order_id": "x" * 65}, "order_id", id="id-over-64"),
    pytest.param({**ORDER, "order_id": "\u0661"}, "order_id", id="id-arabic-digit"),
    pytest.param({**ORDER, "order_id": 0}, "order_id", id="id-zero"),
    pytest.param({**ORDER, "order_id": []}, "order_id", id="id-empty-list"),
    pytest.param({**ORDER, "order_id": {}}, "order_id", id="id-empty-object"),
    pytest.param({**ORDER, "order_id": ""}, "order_id", id="id-empty-string"),
    pytest.param({**ORDER, "order_id": None}, "order_id", id="id-null"),
    pytest.param({**ORDER, "order_id": False}, "order_id", id="id-false"),
    pytest.param({**ORDER, "lines": [{"sku": "s\ud800", "quantity": 1, "unit_price_cents": 1}]}, "sku", id="sku-surrogate"),
    pytest.param({**ORDER, "lines": [{"sku": "s", "quantity": 2**31, "unit_price_cents": 1}]}, "quantity", id="qty-int32"),
    pytest.param({**ORDER, "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 2**63}]}, "unit_price_cents",
                 id="price-int64"),
    pytest.param({**ORDER, "lines": [{"sku": "s", "quantity": 2**31 - 1, "unit_price_cents": 2**62}]}, "total",
                 id="total-past-int64"),
    pytest.param({**ORDER, "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1, "x": 1}]}, "unknown",
                 id="line-unknown-field"),
]


@pytest.mark.parametrize(("body", "match"), BAD_BODIES)
def test_values_the_columns_cannot_hold_are_400_and_write_nothing(db: tuple[FlaskClient, Any], tables: Tables,
                                                                  body: dict[str, Any], match: str) -> None:
    client, sessions = db
    # Given a body with one value no column can hold; When it is POSTed
    r = client.post("/orders", data=json.dumps(body), content_type="application/json")
    # Then 400 naming the field, and neither an order nor an event was written
    assert r.status_code == 400, r.get_data(as_text=True)
    assert match in assert_clean(r)["error"]
    assert counts(sessions, tables) == (0, 0)


@pytest.mark.parametrize(("raw", "match"), [
    (b"[" * 30_000 + b"]" * 30_000, "deeper"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "deeper"),
    (b'{"order_id": NaN}', "NaN"),
    (b'{"order_id": "a", "order_id": "b"}', "duplicate"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"[" + b"1" * 5000 + b"]", "not valid JSON"),
])
def test_bodies_the_decoder_must_not_take_are_400(db: tuple[FlaskClient, Any], tables: Tables, raw: bytes,
                                                  match: str) -> None:
    client, sessions = db
    # Given a body past the depth limit, with NaN, duplicate keys, not UTF-8 or a 5000-digit number
    r = client.post("/orders", data=raw, content_type="application/json")
    # Then 400 and nothing written
    assert r.status_code == 400 and match in assert_clean(r)["error"]
    assert counts(sessions, tables) == (0, 0)


def test_nesting_up_to_the_limit_is_decoded_then_validated(client: FlaskClient) -> None:
    # Given a body nested exactly max_json_depth (64) deep; Then it is decoded and refused by validation
    r = client.post("/orders", data=json.dumps({**ORDER, "lines": [json.loads("[" * 62 + "]" * 62)]}),
                    content_type="application/json")
    assert r.status_code == 400 and "lines[0]" in assert_clean(r)["error"]


@pytest.mark.parametrize("headers", [{"X-Correlation-Id": "has space"}, {"X-Correlation-Id": "c" * 129},
                                     {"Idempotency-Key": ""}, {"Idempotency-Key": "k\x00"}, {"Idempotency-Key": "x" * 65}])
def test_bad_headers_are_400(client: FlaskClient, sqlite_sessions: sessionmaker[Session], tables: Tables,
                             headers: dict[str, str]) -> None:
    body = {k: v for k, v in ORDER.items() if k != "order_id"}
    r = client.post("/orders", json=body, headers=headers)
    assert r.status_code == 400 and assert_clean(r)
    assert counts(sqlite_sessions, tables) == (0, 0)


def test_idempotency_key_makes_a_retry_return_the_original(db: tuple[FlaskClient, Any], tables: Tables) -> None:
    client, sessions = db
    body = {k: v for k, v in ORDER.items() if k != "order_id"}
    key = {"Idempotency-Key": "3f2b8a1e-9c4d-4e8f-a1b2-c3d4e5f6a7b8"}
    # Given an order placed with an Idempotency-Key
    first = client.post("/orders", json=body, headers=key)
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    assert assert_clean(first)["order_id"] == key["Idempotency-Key"]
    # When the client retries the same body with the same key (it never saw the answer)
    again = client.post("/orders", json=body, headers=key)
    # Then it gets the original 201 and order, marked as a replay, and nothing is written twice
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert assert_clean(again) == first.json
    assert counts(sessions, tables) == (1, 2)
    # And the same key with another body is refused (422), still one order, one event
    other = client.post("/orders", json={**body, "email": "b@example.com"}, headers=key)
    assert other.status_code == 422 and "Idempotency-Key" in assert_clean(other)["error"]
    # And a key that disagrees with the body's order_id is a 400
    clash = client.post("/orders", json={**body, "order_id": "o-other"}, headers=key)
    assert clash.status_code == 400 and assert_clean(clash)
    assert counts(sessions, tables) == (1, 2)


def test_without_a_key_a_reused_order_id_stays_409(client: FlaskClient) -> None:
    assert client.post("/orders", json=ORDER).status_code == 201
    r = client.post("/orders", json=ORDER)
    assert r.status_code == 409 and "already exists" in assert_clean(r)["error"]


def test_unknown_routes_and_methods_are_json(client: FlaskClient) -> None:
    for r in (client.get("/nope"), client.put("/orders"), client.delete("/orders/o-1")):
        assert r.status_code in (404, 405) and assert_clean(r)
    assert "POST" in client.put("/orders").headers["Allow"]


@pytest.mark.postgres
def test_a_value_the_database_refuses_is_a_400_not_a_503(pg_url: str, pg_sessions: sessionmaker[Session],
                                                         settings: Settings, clock: ManualClock, tables: Tables,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Given validation that (hypothetically) let a 4-letter currency through to Postgres' varchar(3)
    client = make_client(settings.replace(database_url=pg_url), pg_sessions, clock)
    from orders.service import LineRequest

    def lax(data: Any, **_kw: Any) -> OrderRequest:
        return OrderRequest(order_id="o-lax", customer_id="c", email="a@example.com", currency="EURO",
                            lines=(LineRequest(sku="s", quantity=1, unit_price_cents=1),))

    monkeypatch.setattr(web, "parse_order", lax)
    # When it is POSTed; Then Postgres' DataError is the client's 400, with no database text
    r = client.post("/orders", json=ORDER)
    assert r.status_code == 400, r.get_data(as_text=True)
    assert "cannot store" in assert_clean(r)["error"]
    assert counts(pg_sessions, tables) == (0, 0)


# -- the admin page ----------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["outbox:\u00b2", "consumer:\u2460", "consumer:\u0661", "outbox:\uff11", "consumer:01",
                                 "consumer:-1", "consumer:99999999999999999999", "consumer:1\u2003", "consumer:1%00",
                                 "consumer:"])
def test_admin_ids_are_ascii_digits_only(client: FlaskClient, sqlite_sessions: sessionmaker[Session], tables: Tables,
                                         raw: str) -> None:
    # Given dead letters outbox:1 and consumer:1
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10, payload={"secret_of": "outbox-1"})
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", error="consumer-1-error")
    assert (row.seq, cid) == (1, 1)
    bearer = {"Authorization": "Bearer t0ken-0123456789ab"}
    path = "/admin/dead-letters/" + urllib.parse.quote(raw, safe=":%")
    # When a look-alike id is opened; Then a clean 400/404, never dead letter 1 and never a 5xx
    r = client.get(path, headers=bearer)
    assert r.status_code in (400, 404)
    assert "consumer-1-error" not in r.get_data(as_text=True) and "outbox-1" not in r.get_data(as_text=True)
    # And replaying it changes nothing
    client.get("/admin/dead-letters/", headers=bearer)
    token = client.get_cookie(CSRF_COOKIE, path="/admin/")
    assert token is not None
    before = counts(sqlite_sessions, tables)
    post = client.post(path + "/replay", headers=bearer, data={"csrf_token": token.value})
    assert post.status_code in (303, 400, 404)
    with sqlite_sessions() as s:
        assert s.scalar(sa.select(tables.dead_letters.replayed_at_ms)) is None
        assert s.scalar(sa.select(tables.outbox.dead_lettered_at_ms)) == T0
    assert counts(sqlite_sessions, tables) == before
