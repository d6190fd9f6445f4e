"""The dead-letter page in a real headless Chromium: list, open one, replay it, see it disappear.

Served by werkzeug on a free loopback port in a thread; driven with Playwright against Debian's
``/usr/bin/chromium`` (never a downloaded browser). Skips locally without chromium, FAILS under CI=true.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker
from werkzeug.serving import make_server

from celery_outbox import Tables
from celery_outbox.clock import SystemClock
from celery_outbox.contrib.flask import EXT
from celeryconfig import Settings
from relay.web import create_app
from tests.ops_seed import T0, consumer_dead_letter, envelope, outbox_row
from tests.services import IN_CI

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "browser-token-0123"


def require_chromium() -> None:
    if not os.access(CHROMIUM, os.X_OK):
        reason = f"{CHROMIUM} is missing; apt-get install -y chromium"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def sent() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture
def server(settings: Settings, sqlite_sessions: sessionmaker[Session],
           sent: list[tuple[str, dict[str, Any]]]) -> Iterator[str]:
    app = create_app(settings=settings.replace(admin_token=TOKEN), session_factory=sqlite_sessions,
                     clock=SystemClock())
    app.extensions[EXT]["send"] = lambda consumer, env: sent.append((consumer, env))
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        t.join(timeout=10)


def state(sessions: sessionmaker[Session], tables: Tables) -> tuple[Any, ...]:
    outbox, dead_letters = tables.outbox, tables.dead_letters
    with sessions() as s:
        return (s.execute(sa.select(outbox.seq, outbox.dead_lettered_at_ms)).all(),
                s.execute(sa.select(dead_letters.id, dead_letters.replayed_at_ms)).all())


def test_list_open_replay_disappear(server: str, sqlite_sessions: sessionmaker[Session], tmp_path: Path,
                                    sent: list[tuple[str, dict[str, Any]]], tables: Tables) -> None:
    require_chromium()
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    now = SystemClock().now_ms()
    env = envelope("o-browser")
    with sqlite_sessions() as s:
        dead = outbox_row(s, tables=tables, created_at_ms=T0, dead_lettered_at_ms=now - 3_600_000, attempts=10,
                          last_error="broker nacked the message")
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", env=env, failed_at_ms=now - 120_000,
                                   error="RuntimeError: payment gateway down")
    before = state(sqlite_sessions, tables)

    # An unauthenticated POST (no browser session at all) is refused and changes nothing
    req = urllib.request.Request(f"{server}/admin/dead-letters/consumer:{cid}/replay", data=b"csrf_token=x",
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401

    with sync_playwright() as p:
        # Without credentials the browser gets 401 and sees no dead letter
        anon = p.chromium.launch_persistent_context(str(tmp_path / "anon-profile"), executable_path=CHROMIUM,
                                                    args=ARGS, headless=True)
        try:
            page = anon.new_page()
            # Chromium has no credentials to offer, so it abandons the navigation (no page rendered)
            with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                page.goto(f"{server}/admin/dead-letters/")
            # and the same request from the browser context, status visible: 401
            api = anon.request.get(f"{server}/admin/dead-letters/")
            assert api.status == 401 and "billing" not in api.text()
            posted = anon.request.post(f"{server}/admin/dead-letters/outbox:{dead.seq}/purge",
                                       form={"csrf_token": "x"})
            assert posted.status == 401
        finally:
            anon.close()
        assert state(sqlite_sessions, tables) == before and sent == []

        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, args=ARGS, headless=True,
            http_credentials={"username": "oncall", "password": TOKEN})
        try:
            page = ctx.new_page()
            # List: both dead letters with age, source, consumer and error
            resp = page.goto(f"{server}/admin/dead-letters/")
            assert resp is not None and resp.status == 200
            rows = page.locator("#dead-letters tr[data-id]")
            assert rows.count() == 2
            outbox_tr = page.locator(f'tr[data-id="outbox:{dead.seq}"]')
            billing_tr = page.locator(f'tr[data-id="consumer:{cid}"]')
            assert "1h 0m" in outbox_tr.inner_text() and "outbox" in outbox_tr.inner_text()
            assert "billing" in billing_tr.inner_text() and "payment gateway down" in billing_tr.inner_text()
            # Open one: its payload is shown
            billing_tr.locator("a").click()
            page.wait_for_url(f"**/admin/dead-letters/consumer:{cid}")
            assert "o-browser" in page.locator("#payload").inner_text()
            # Replay it: back on the list, it is gone and the outbox one remains
            page.locator(f'button.replay[data-id="consumer:{cid}"]').click()
            page.wait_for_url("**/admin/dead-letters/?done=*")
            assert "re-sent" in page.locator("#flash").inner_text()
            assert page.locator("#dead-letters tr[data-id]").count() == 1
            assert page.locator(f'tr[data-id="consumer:{cid}"]').count() == 0
            # Replay the outbox row from the list: the table is empty
            page.locator(f'button.replay[data-id="outbox:{dead.seq}"]').click()
            page.wait_for_url("**/admin/dead-letters/?done=*")
            assert page.locator("#count").inner_text() == "0 dead letter(s)"
        finally:
            ctx.close()

    assert sent == [("billing", env)]
    outbox_rows, consumer_rows = state(sqlite_sessions, tables)
    assert outbox_rows == [(dead.seq, None)]
    assert consumer_rows[0][1] is not None
