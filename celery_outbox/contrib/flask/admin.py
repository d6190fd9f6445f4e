"""The dead-letter admin pages: a Flask blueprint at ``/admin/dead-letters`` (the list, one dead letter,
the groups, one message's trace; replay and purge), rendered from ``templates/outbox_admin/``.

Access: ``settings.admin_token`` as a bearer token (``Authorization: Bearer <token>``) or as the
basic-auth password (any user name). With no token configured the page does not exist (404), so a
forgotten setting never means an open admin page.

CSRF: every form carries a random token that must equal the ``outbox_csrf`` cookie (double submit);
the cookie is ``SameSite=Strict`` and HttpOnly, and a POST that the browser marks as not same-origin
(``Sec-Fetch-Site``), or whose Origin is another site or ``null``, is refused.
A cross-site form cannot read the cookie, so it cannot forge the field.

Headers: every answer carries the strict Content-Security-Policy of ``csp.py``,
``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and, when the request came over
https, ``Strict-Transport-Security`` (behind a TLS-terminating proxy, wrap the app in werkzeug's
``ProxyFix`` so Flask sees the scheme).
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from flask import Blueprint, Response, abort, current_app, g, redirect, render_template, request, url_for
from markupsafe import Markup
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from werkzeug.wrappers import Response as WerkzeugResponse

from celery_outbox.celery.sender import replay_sender
from celery_outbox.clock import Clock
from celery_outbox.contrib.flask.csp import CONTENT_SECURITY_POLICY, SCRIPT, STYLE, security_headers
from celery_outbox.errors import DatabaseError, NotFoundError, OutboxError
from celery_outbox.ops import dead_letter_groups as dl_groups
from celery_outbox.ops import dead_letters as dl
from celery_outbox.ops import trace as ops_trace
from celery_outbox.outbox import Outbox
from celery_outbox.settings import Settings

CSRF_COOKIE = "outbox_csrf"
CSRF_FIELD = "csrf_token"
EXT = "outbox_ops"  # app.extensions key: the outbox, the replay sender and the metrics registry of the pages


def _human_age(ms: int) -> str:
    """``3d 4h``, ``2h 5m``, ``7m 3s``, ``12s``: enough to see at a glance what is stale."""
    s = ms // 1000
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    if m:
        return f"{m}m {s % 60}s"
    return f"{s}s"


def _ctx() -> dict[str, Any]:
    ext: dict[str, Any] = current_app.extensions[EXT]
    return ext


def _outbox() -> Outbox:
    o: Outbox = _ctx()["outbox"]
    return o


def _settings() -> Settings:
    return _outbox().settings


def _session() -> Session:
    if "ops_db" not in g:
        g.ops_db = _outbox().sessions()()
    s: Session = g.ops_db
    return s


def _clock() -> Clock:
    return _outbox().clock


def _authorized(token: str) -> bool:
    auth = request.authorization
    if auth is not None:
        if auth.type == "bearer" and auth.token is not None:
            return hmac.compare_digest(auth.token.encode(), token.encode())
        if auth.type == "basic" and auth.password is not None:
            return hmac.compare_digest(auth.password.encode(), token.encode())
    return False


def _same_origin() -> bool:
    """A browser's ``Sec-Fetch-Site`` (a header no page can set) must say same-origin. Without it, the
    Origin (or Referer) must be this host. The page's ``Referrer-Policy: no-referrer`` makes browsers send
    ``Origin: null`` on its own forms, which is why Fetch Metadata is asked first; a bare ``null`` is refused,
    and so is an Origin or Referer that is no URL (``http://[::1``: the parser raises on it)."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("Origin") or request.headers.get("Referer")
    if not origin or origin == "null":
        return origin is None
    try:
        netloc = urlparse(origin).netloc
    except ValueError:
        return False
    return netloc == request.host


def _csrf_token() -> str:
    tok = request.cookies.get(CSRF_COOKIE, "")
    if len(tok) < 32:
        tok = g.get("new_csrf") or secrets.token_urlsafe(32)
        g.new_csrf = tok
    return tok


def _sender() -> dl.Sender:
    ext = _ctx()
    if ext.get("send") is None:
        ext["send"] = replay_sender(_outbox().app, _outbox())
    send: dl.Sender = ext["send"]
    return send


def _pretty(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, sort_keys=True, default=str)
    except (RecursionError, ValueError):
        return "(nested too deep to show)"


def _page(template: str, **kw: Any) -> str:
    """Render ``templates/outbox_admin/<template>``: the layout gets the style and script the CSP pins."""
    now = _clock().now_ms()
    return render_template(
        f"outbox_admin/{template}", csrf=_csrf_token(), style=Markup(STYLE), script=Markup(SCRIPT),
        age=lambda d: _human_age(d.age_ms(now)),
        ago=lambda ms: "-" if ms is None else _human_age(max(0, now - ms)) + " ago",
        pretty=_pretty, **kw,
    )


def make_blueprint() -> Blueprint:
    bp = Blueprint("outbox_admin", __name__, url_prefix="/admin/dead-letters", template_folder="templates")

    @bp.before_request
    def _guard() -> Response | None:
        token = _settings().admin_token
        if not token:
            abort(404)
        if not _authorized(token):
            return Response("authentication required\n", 401,
                            {"WWW-Authenticate": 'Basic realm="outbox admin", charset="UTF-8"'})
        if request.method == "POST":
            sent = request.form.get(CSRF_FIELD, "")
            cookie = request.cookies.get(CSRF_COOKIE, "")
            if not _same_origin() or not cookie or not hmac.compare_digest(sent.encode(), cookie.encode()):
                return Response("CSRF check failed: reload the page and try again\n", 403)
        return None

    @bp.after_request
    def _set_csrf(resp: Response) -> Response:
        new = g.get("new_csrf")
        if new:
            resp.set_cookie(CSRF_COOKIE, new, httponly=True, samesite="Strict", secure=request.is_secure,
                            path="/admin/")
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY  # the page's own, whatever the host set
        security_headers(resp)
        return resp

    @bp.errorhandler(DatabaseError)
    @bp.errorhandler(sa_exc.SQLAlchemyError)
    def _database_down(_e: Exception) -> Response:
        # the database's text (host, port, SQL) stays in the server log, never in the answer
        current_app.logger.warning("admin page: database error", exc_info=True)
        return Response("the database is unavailable; try again shortly\n", 503,
                        {"Retry-After": "5", "Content-Type": "text/plain; charset=utf-8"})

    @bp.teardown_request
    def _close(_exc: BaseException | None) -> None:
        s = g.pop("ops_db", None)
        if s is not None:
            s.close()

    @bp.get("/")
    def index() -> str:
        items = dl.list_dead_letters(_session(), tables=_outbox().tables)
        return _page("list.html", title="Dead letters", items=items, flash=request.args.get("done"),
                     error=request.args.get("error"))

    @bp.get("/groups")
    def groups() -> str:
        found = dl_groups.list_groups(_session(), tables=_outbox().tables)
        return _page("groups.html", title="Dead-letter groups", groups=found, total=sum(g.count for g in found))

    @bp.get("/trace")
    def trace() -> tuple[str, int]:
        """One message's story (``outbox trace``): ``?key=`` a message id, an entity key or a correlation id."""
        key = request.args.get("key", "")
        traces: list[ops_trace.MessageTrace] = []
        error, status = None, 200
        if key:
            outbox = _outbox()
            try:
                traces = ops_trace.trace(_session(), key, tables=outbox.tables, routes=outbox.routes(),
                                         idempotent_tasks=outbox.idempotent_tasks())
            except NotFoundError as e:
                error, status = str(e), 404
            except DatabaseError:
                raise  # 503 without the database's text
            except OutboxError as e:
                error, status = str(e), 400
        return _page("trace.html", title="Trace a message", key=key, traces=traces, error=error,
                     not_recorded="; ".join(ops_trace.NOT_RECORDED)), status

    @bp.get("/<dl_id>")
    def show(dl_id: str) -> str:
        try:
            d = dl.get(_session(), dl_id, tables=_outbox().tables)
        except NotFoundError:
            abort(404)
        except OutboxError:
            abort(400)
        return _page("show.html", title=f"Dead letter {d.id}", d=d)

    def _act(dl_id: str, action: Callable[[Session, str], str]) -> WerkzeugResponse:
        try:
            message = action(_session(), dl_id)
        except DatabaseError:
            raise  # 503 without the database's text, not a redirect that shows it
        except OutboxError as e:
            return redirect(url_for("outbox_admin.index", error=str(e)), 303)
        return redirect(url_for("outbox_admin.index", done=message), 303)

    @bp.post("/<dl_id>/replay")
    def replay(dl_id: str) -> WerkzeugResponse:
        def run(session: Session, raw: str) -> str:
            ref = dl.DeadLetterId.parse(raw)
            send = _sender() if ref.source == "consumer" else None
            (result,) = dl.replay(session, [ref], tables=_outbox().tables, clock=_clock(), send=send)
            return f"{result.id}: {result.detail}"
        return _act(dl_id, run)

    @bp.post("/<dl_id>/purge")
    def purge(dl_id: str) -> WerkzeugResponse:
        def run(session: Session, raw: str) -> str:
            n = dl.purge(session, [raw], tables=_outbox().tables)
            return f"{raw}: purged ({n} row)"
        return _act(dl_id, run)

    return bp
