"""The admin page: no token configured = no page; no credentials = 401 and nothing changes; CSRF on POSTs."""

from __future__ import annotations

import base64
import re
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.contrib.flask import CSRF_COOKIE, EXT
from celery_outbox.schema import Tables
from celeryconfig import Settings
from relay.web import create_app
from tests.ops_seed import T0, consumer_dead_letter, envelope, outbox_row

TOKEN = "s3cret-token-0123456"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def sent() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture
def client(settings: Settings, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
           sent: list[tuple[str, dict[str, Any]]]) -> FlaskClient:
    app = create_app(settings=settings.replace(admin_token=TOKEN), session_factory=sqlite_sessions, clock=clock)
    app.extensions[EXT]["send"] = lambda consumer, env: sent.append((consumer, env))
    return app.test_client()


def state(sessions: sessionmaker[Session], tables: Tables) -> tuple[Any, ...]:
    ob, cdl = tables.outbox, tables.dead_letters
    with sessions() as s:
        return (s.execute(sa.select(ob.seq, ob.dead_lettered_at_ms, ob.attempts).order_by(ob.seq)).all(),
                s.execute(sa.select(cdl.id, cdl.replayed_at_ms).order_by(cdl.id)).all())


def csrf_of(client: FlaskClient, html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, html
    cookie = client.get_cookie(CSRF_COOKIE, path="/admin/")
    assert cookie is not None and cookie.value == m.group(1)
    return m.group(1)


def test_no_token_configured_means_no_page(settings: Settings, sqlite_sessions: sessionmaker[Session],
                                           clock: ManualClock) -> None:
    client = create_app(settings=settings.replace(admin_token=""), session_factory=sqlite_sessions,
                        clock=clock).test_client()
    assert client.get("/admin/dead-letters/").status_code == 404
    assert client.get("/admin/dead-letters/", headers={"Authorization": "Bearer "}).status_code == 404
    assert client.post("/admin/dead-letters/outbox:1/replay").status_code == 404


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"},
    {"Authorization": "Basic " + base64.b64encode(b"admin:wrong").decode()},
    {"Authorization": "Basic " + base64.b64encode(TOKEN.encode() + b":").decode()},  # token as user, not password
])
def test_unauthenticated_gets_401_and_changes_nothing(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                                      tables: Tables, headers: dict[str, str],
                                                      sent: list[tuple[str, dict[str, Any]]]) -> None:
    # Given a dead letter of each kind
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
        cid = consumer_dead_letter(s, tables=tables)
    before = state(sqlite_sessions, tables)
    # When someone without the token lists, replays and purges
    r = client.get("/admin/dead-letters/", headers=headers)
    assert r.status_code == 401 and "Basic" in r.headers["WWW-Authenticate"]
    for path in (f"outbox:{row.seq}/replay", f"consumer:{cid}/replay", f"outbox:{row.seq}/purge"):
        assert client.post(f"/admin/dead-letters/{path}", headers=headers,
                           data={"csrf_token": "x"}).status_code == 401
    assert client.get(f"/admin/dead-letters/outbox:{row.seq}", headers=headers).status_code == 401
    # Then nothing was replayed, sent or purged
    assert state(sqlite_sessions, tables) == before and sent == []


def test_list_show_replay_with_bearer(client: FlaskClient, sqlite_sessions: sessionmaker[Session], tables: Tables,
                                      clock: ManualClock, sent: list[tuple[str, dict[str, Any]]]) -> None:
    env = envelope("o-77")
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10, last_error="<script>alert(1)</script>")
        cid = consumer_dead_letter(s, tables=tables, consumer="email", env=env, error="smtp 554")
    clock.set(T0 + 90_000)
    page = client.get("/admin/dead-letters/", headers=BEARER)
    html = page.get_data(as_text=True)
    assert page.status_code == 200 and "2 dead letter(s)" in html
    assert f"outbox:{row.seq}" in html and f"consumer:{cid}" in html and "1m 30s" in html
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html  # escaped
    detail = client.get(f"/admin/dead-letters/consumer:{cid}", headers=BEARER).get_data(as_text=True)
    assert "o-77" in detail and "smtp 554" in detail
    token = csrf_of(client, html)
    r = client.post(f"/admin/dead-letters/consumer:{cid}/replay", headers=BEARER, data={"csrf_token": token})
    assert r.status_code == 303
    assert sent == [("email", env)]
    after = client.get(r.headers["Location"], headers=BEARER).get_data(as_text=True)
    assert "1 dead letter(s)" in after and f"consumer:{cid}: re-sent" in after
    r = client.post(f"/admin/dead-letters/outbox:{row.seq}/replay", headers=BEARER, data={"csrf_token": token})
    assert r.status_code == 303
    assert state(sqlite_sessions, tables)[0] == [(row.seq, None, 0)]


def test_the_detail_page_shows_the_task_id_of_the_failure_flower_shows(client: FlaskClient,
                                                                      sqlite_sessions: sessionmaker[Session],
                                                                      tables: Tables) -> None:
    from celery_outbox.inbox import dead_letters as store

    # Given a consumer dead letter kept with its delivery's task id, and an outbox one (no task)
    tid = "7f1c2a34-0b9e-4d55-8a1e-4c7b9e0d1f21"
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
        cid = store.record(s, tables=tables, consumer="email", message_id=str(uuid.uuid4()), type="OrderPlaced",
                           body="{}", headers={}, delivery_count=3, last_error="smtp 554", first_failed_at_ms=T0,
                           last_failed_at_ms=T0, task_id=tid).id
        s.commit()
    # When their pages are opened, the consumer one names the task id and the outbox one none
    consumer_page = client.get(f"/admin/dead-letters/consumer:{cid}", headers=BEARER).get_data(as_text=True)
    outbox_page = client.get(f"/admin/dead-letters/outbox:{row.seq}", headers=BEARER).get_data(as_text=True)
    assert f'<td id="task-id">{tid}</td>' in consumer_page
    assert '<td id="task-id">-</td>' in outbox_page


def test_basic_auth_works_and_post_without_csrf_is_refused(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                                           tables: Tables) -> None:
    basic = {"Authorization": "Basic " + base64.b64encode(f"ops:{TOKEN}".encode()).decode()}
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    html = client.get("/admin/dead-letters/", headers=basic).get_data(as_text=True)
    token = csrf_of(client, html)
    before = state(sqlite_sessions, tables)
    url = f"/admin/dead-letters/outbox:{row.seq}/purge"
    # no field; wrong field; right field from another origin
    assert client.post(url, headers=basic).status_code == 403
    assert client.post(url, headers=basic, data={"csrf_token": "forged"}).status_code == 403
    assert client.post(url, headers={**basic, "Origin": "https://evil.example"},
                       data={"csrf_token": token}).status_code == 403
    assert state(sqlite_sessions, tables) == before
    # a field without the cookie (a cross-site form cannot send the SameSite=Strict cookie)
    client.delete_cookie(CSRF_COOKIE, path="/admin/")
    assert client.post(url, headers=basic, data={"csrf_token": token}).status_code == 403
    assert state(sqlite_sessions, tables) == before
    html = client.get("/admin/dead-letters/", headers=basic).get_data(as_text=True)
    r = client.post(url, headers={**basic, "Origin": "http://localhost"}, data={"csrf_token": csrf_of(client, html)})
    assert r.status_code == 303
    assert state(sqlite_sessions, tables)[0] == []


def test_bad_ids(client: FlaskClient, sqlite_sessions: sessionmaker[Session]) -> None:
    assert client.get("/admin/dead-letters/outbox:999", headers=BEARER).status_code == 404
    assert client.get("/admin/dead-letters/nonsense", headers=BEARER).status_code == 400
    html = client.get("/admin/dead-letters/", headers=BEARER).get_data(as_text=True)
    token = client.get_cookie(CSRF_COOKIE, path="/admin/")
    assert token is not None and "0 dead letter(s)" in html
    r = client.post("/admin/dead-letters/outbox:999/replay", headers=BEARER, data={"csrf_token": token.value})
    assert r.status_code == 303 and "error=" in r.headers["Location"]
    assert "no such dead letter" in client.get(r.headers["Location"], headers=BEARER).get_data(as_text=True)


def _csp_hash(text: str) -> str:
    import hashlib

    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_every_admin_answer_carries_the_security_headers(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                                         tables: Tables, settings: Settings, clock: ManualClock) -> None:
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    page = client.get("/admin/dead-letters/", headers=BEARER)
    html = page.get_data(as_text=True)
    token = csrf_of(client, html)
    no_page = create_app(settings=settings.replace(admin_token=""), session_factory=sqlite_sessions,
                         clock=clock).test_client().get("/admin/dead-letters/")
    answers = {
        "list": page, "show": client.get(f"/admin/dead-letters/outbox:{row.seq}", headers=BEARER),
        "401": client.get("/admin/dead-letters/"), "403": client.post(f"/admin/dead-letters/outbox:{row.seq}/replay",
                                                                       headers=BEARER),
        "400": client.get("/admin/dead-letters/consumer:\u0661", headers=BEARER),
        "404": client.get("/admin/dead-letters/outbox:999", headers=BEARER), "no-token-404": no_page,
        "303": client.post(f"/admin/dead-letters/outbox:{row.seq}/replay", headers=BEARER, data={"csrf_token": token}),
        "metrics": client.get("/metrics"),
    }
    assert [answers[k].status_code for k in ("401", "403", "400", "404", "no-token-404", "303")] == [
        401, 403, 400, 404, 404, 303]
    for name, r in answers.items():
        csp = [d.strip() for d in r.headers.get("Content-Security-Policy", "").split(";")]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp, (name, csp)
        assert r.headers["X-Content-Type-Options"] == "nosniff", name
        assert r.headers["Referrer-Policy"] == "no-referrer", name
        assert "Strict-Transport-Security" not in r.headers, name  # plain http: no HSTS
    # The page's own policy allows exactly its inline style and script (by hash) and posts to itself only
    policy = page.headers["Content-Security-Policy"]
    style = re.search(r"<style>(.*?)</style>", html, re.DOTALL)
    script = re.search(r"<script>(.*?)</script>", html, re.DOTALL)
    assert style and script
    assert f"style-src {_csp_hash(style.group(1))}" in policy and f"script-src {_csp_hash(script.group(1))}" in policy
    assert "form-action 'self'" in policy and "unsafe-inline" not in policy
    assert re.search(r"\son[a-z]+=", html) is None  # no inline event handler (the CSP would block it)


def test_hsts_only_over_https(client: FlaskClient) -> None:
    r = client.get("/admin/dead-letters/", headers=BEARER, base_url="https://localhost")
    assert r.status_code == 200 and r.headers["Strict-Transport-Security"].startswith("max-age=")
    api = client.get("/orders/missing", base_url="https://localhost")
    assert api.headers["Strict-Transport-Security"].startswith("max-age=")
    assert "Strict-Transport-Security" not in client.get("/orders/missing").headers


def test_fetch_metadata_decides_same_origin(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                            tables: Tables) -> None:
    # Given the page (Referrer-Policy no-referrer: a browser's own form posts carry Origin: null)
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    token = csrf_of(client, client.get("/admin/dead-letters/", headers=BEARER).get_data(as_text=True))
    url = f"/admin/dead-letters/outbox:{row.seq}/replay"
    before = state(sqlite_sessions, tables)
    # When the browser says the POST is cross-site, or sends a bare Origin: null; Then it is refused
    for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site", "Origin": "http://localhost"}):
        assert client.post(url, headers={**BEARER, **headers}, data={"csrf_token": token}).status_code == 403
    assert state(sqlite_sessions, tables) == before
    # And the page's own form (same-origin per Fetch Metadata, Origin null) is accepted
    r = client.post(url, headers={**BEARER, "Sec-Fetch-Site": "same-origin", "Origin": "null"},
                    data={"csrf_token": token})
    assert r.status_code == 303 and state(sqlite_sessions, tables)[0] == [(row.seq, None, 0)]


@pytest.mark.parametrize("headers", [{"Origin": "http://[::1"}, {"Referer": "http://[localhost/admin/"},
                                     {"Origin": "http://localhost]"}])
def test_an_origin_that_is_no_url_is_refused_not_a_500(client: FlaskClient, sqlite_sessions: sessionmaker[Session],
                                                       tables: Tables, headers: dict[str, str]) -> None:
    # Given a dead letter and the page's CSRF token
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    token = csrf_of(client, client.get("/admin/dead-letters/", headers=BEARER).get_data(as_text=True))
    before = state(sqlite_sessions, tables)
    # When a POST carries an Origin or Referer that no URL parser reads (an unclosed IPv6 bracket)
    r = client.post(f"/admin/dead-letters/outbox:{row.seq}/replay", headers={**BEARER, **headers},
                    data={"csrf_token": token})
    # Then it is the CSRF refusal (403, one line), not an internal error, and nothing changed
    assert r.status_code == 403, r.get_data(as_text=True)
    assert r.get_data(as_text=True) == "CSRF check failed: reload the page and try again\n"
    assert state(sqlite_sessions, tables) == before
