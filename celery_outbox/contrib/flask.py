"""Flask: the ``FlaskOutbox`` extension, and the dead-letter admin page (``/admin/dead-letters``, with the
groups and one message's trace), ``/metrics`` and ``/readyz`` it mounts (``init_app(app, outbox)`` mounts them on any app).

The extension, in the usual shape (declare at import, bind in the app factory)::

    db = SQLAlchemy(model_class=Base)
    outbox = FlaskOutbox()
    outbox.define_tables(Base.metadata)

    @outbox.consumer("OrderPlaced", name="notify")
    def notify(session, event): ...

    @outbox.task(name="shop.confirm")                 # importable by any module: a proxy of each app's task
    def confirm(session, order_id): ...

    def create_app():
        app = Flask("shop")
        app.config.from_prefixed_env()            # OUTBOX_*, SQLALCHEMY_DATABASE_URI, CELERY...
        db.init_app(app)
        outbox.init_app(app, db=db)
        return app

``init_app`` builds the app's ``Outbox`` from ``app.config``'s ``OUTBOX_*`` keys (explicit arguments:
they beat the environment, which beats the defaults), on Flask-SQLAlchemy's ``db.engine`` (one pool),
on the Celery app in ``app.extensions["celery"]`` (or a new one configured from ``app.config["CELERY"]``,
as Flask's Celery guide does), merges ``recommended_celery_config`` into it, mounts ``/readyz``,
``/metrics`` and the dead-letter page, and adds ``flask outbox ...``: the ``outbox`` command's
commands, on this app's outbox.

Access: ``settings.admin_token`` as a bearer token (``Authorization: Bearer <token>``) or as the
basic-auth password (any user name). With no token configured the page does not exist (404), so a
forgotten setting never means an open admin page.

CSRF: every form carries a random token that must equal the ``outbox_csrf`` cookie (double submit);
the cookie is ``SameSite=Strict`` and HttpOnly, and a POST that the browser marks as not same-origin
(``Sec-Fetch-Site``), or whose Origin is another site or ``null``, is refused.
A cross-site form cannot read the cookie, so it cannot forge the field.

Headers: every answer of the page (and ``/metrics``) carries a strict Content-Security-Policy (nothing
loads but the page's own inline style and confirm script, pinned by their SHA-256; forms post only to
this origin; no framing), ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and,
when the request came over https, ``Strict-Transport-Security`` (behind a TLS-terminating proxy, wrap
the app in werkzeug's ``ProxyFix`` so Flask sees the scheme).
"""

from __future__ import annotations

from celery_outbox.errors import missing_extra

try:
    import flask  # noqa: F401  (this module needs it: one line naming the extra if it is missing)
except ModuleNotFoundError as e:
    raise missing_extra(e.name, needed_by="celery_outbox.contrib.flask") from None

import base64
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import click
import sqlalchemy as sa
from celery import Celery
from celery.local import Proxy
from flask import (
    Blueprint,
    Flask,
    Response,
    abort,
    current_app,
    g,
    has_app_context,
    redirect,
    render_template_string,
    request,
    url_for,
)
from markupsafe import Markup
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from werkzeug.wrappers import Response as WerkzeugResponse

from celery_outbox.cancel import Cancelled
from celery_outbox.celery.config import recommended_celery_config
from celery_outbox.celery.probe import DEFAULT_TIMEOUT_S as DEFAULT_BROKER_TIMEOUT_S
from celery_outbox.celery.probe import broker_probe
from celery_outbox.celery.queue_depth import queue_probe
from celery_outbox.celery.sender import replay_sender
from celery_outbox.clock import Clock
from celery_outbox.consumer import ConsumerSpec, consumer
from celery_outbox.errors import ConfigError, DatabaseError, NotFoundError, OutboxError
from celery_outbox.inbox.claim import Handler
from celery_outbox.ops import dead_letter_groups as dl_groups
from celery_outbox.ops import dead_letters as dl
from celery_outbox.ops import health
from celery_outbox.ops import metrics as ops_metrics
from celery_outbox.ops import trace as ops_trace
from celery_outbox.outbox import Outbox
from celery_outbox.schema import Tables, define_tables
from celery_outbox.settings import Settings
from celery_outbox.writer import Event

CSRF_COOKIE = "outbox_csrf"
CSRF_FIELD = "csrf_token"
EXT = "outbox_ops"

_STYLE = """body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:4px 8px;text-align:left;vertical-align:top}pre{background:#f4f4f4;padding:1em}
.flash{background:#e8f4e8;padding:.5em}.error{background:#f8e0e0;padding:.5em}form{display:inline}"""
# The purge confirmation, as a script the CSP pins by hash (inline event handlers would need 'unsafe-hashes').
_SCRIPT = """document.addEventListener("submit",function(e){var f=e.target;
if(f.classList&&f.classList.contains("purge-form")&&!confirm("Delete "+f.dataset.id+" for good?")){e.preventDefault();}});"""


def _sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src {_sha256_source(_STYLE)}; script-src {_sha256_source(_SCRIPT)}; "
    "img-src 'none'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HSTS = "max-age=31536000"

_LAYOUT_HEAD = ("""<!doctype html><html><head><meta charset="utf-8"><title>{{ title }}</title>
<style>""" + _STYLE + "</style><script>" + _SCRIPT + """</script>
</head><body>""")

LIST_TEMPLATE = _LAYOUT_HEAD + """
<h1>Dead letters</h1>
<p><a href="{{ url_for('outbox_admin.groups') }}">groups</a> |
<a href="{{ url_for('outbox_admin.trace') }}">trace a message</a></p>
{% if flash %}<p class="flash" id="flash">{{ flash }}</p>{% endif %}
{% if error %}<p class="error" id="error">{{ error }}</p>{% endif %}
<p id="count">{{ items|length }} dead letter(s)</p>
{% if items %}
<table id="dead-letters">
<tr><th>id</th><th>age</th><th>source</th><th>consumer</th><th>type</th><th>attempts</th><th>error</th><th></th></tr>
{% for d in items %}
<tr data-id="{{ d.id }}">
<td><a href="{{ url_for('outbox_admin.show', dl_id=d.id|string) }}">{{ d.id }}</a></td>
<td>{{ age(d) }}</td><td>{{ d.source }}</td><td>{{ d.consumer or "-" }}</td><td>{{ d.type or "?" }}</td>
<td>{{ d.attempts }}</td><td>{{ d.error[:120] }}</td>
<td>{{ buttons(d) }}</td>
</tr>
{% endfor %}
</table>
{% endif %}
</body></html>"""

SHOW_TEMPLATE = _LAYOUT_HEAD + """
<p><a href="{{ url_for('outbox_admin.index') }}">&larr; all dead letters</a></p>
<h1>Dead letter {{ d.id }}</h1>
<table>
<tr><th>source</th><td>{{ d.source }}</td></tr><tr><th>consumer</th><td>{{ d.consumer or "-" }}</td></tr>
<tr><th>message id</th><td>{{ d.message_id }}</td></tr><tr><th>type</th><td>{{ d.type or "?" }}</td></tr>
<tr><th>age</th><td>{{ age(d) }}</td></tr><tr><th>attempts</th><td>{{ d.attempts }}</td></tr>
<tr><th>replayed at</th><td>{{ d.replayed_at_ms or "-" }}</td></tr>
</table>
<h2>Error</h2><pre id="error-text">{{ d.error }}</pre>
<h2>Payload</h2><pre id="payload">{{ pretty(d.payload) }}</pre>
<h2>Headers</h2><pre id="headers">{{ pretty(d.headers) }}</pre>
{{ buttons(d) }}
</body></html>"""

GROUPS_TEMPLATE = _LAYOUT_HEAD + """
<p><a href="{{ url_for('outbox_admin.index') }}">&larr; all dead letters</a></p>
<h1>Dead-letter groups</h1>
<p id="count">{{ groups|length }} group(s), {{ total }} dead letter(s)</p>
{% if groups %}
<table id="groups">
<tr><th>group</th><th>count</th><th>consumer</th><th>error</th><th>first seen</th><th>last seen</th><th>sample</th></tr>
{% for g in groups %}
<tr data-group="{{ g.id }}"><td>{{ g.id }}</td><td>{{ g.count }}</td><td>{{ g.consumer }}</td>
<td>{{ (g.error_class ~ ": " if g.error_class else "") ~ g.message[:120] }}</td>
<td>{{ ago(g.first_seen_ms) }}</td><td>{{ ago(g.last_seen_ms) }}</td>
<td><a href="{{ url_for('outbox_admin.show', dl_id=g.sample_id) }}">{{ g.sample_id }}</a></td></tr>
{% endfor %}
</table>
<p>Replay or purge a whole group, throttled and resumable: <code>outbox dead-letters replay --group GROUP</code>,
<code>outbox dead-letters purge --group GROUP --yes --archive FILE</code>.</p>
{% endif %}
</body></html>"""

TRACE_TEMPLATE = _LAYOUT_HEAD + """
<p><a href="{{ url_for('outbox_admin.index') }}">&larr; all dead letters</a></p>
<h1>Trace a message</h1>
<form method="get" action="{{ url_for('outbox_admin.trace') }}">
<input name="key" value="{{ key }}" size="50" placeholder="message id, entity key (order:42) or correlation id">
<button type="submit">Trace</button></form>
{% if error %}<p class="error" id="error">{{ error }}</p>{% endif %}
{% for t in traces %}
<h2 class="message">{{ t.message_id }} ({{ t.kind }}, {{ t.type or "?" }}): {{ t.state }}</h2>
<table class="outbox-hop">
<tr><th>entity key / correlation</th><td>{{ t.entity_key or "-" }} / {{ t.correlation_id or "-" }}</td></tr>
<tr><th>committed</th><td>{{ ago(t.created_at_ms) }}</td></tr>
<tr><th>published</th><td>{{ ago(t.published_at_ms) }}{% if t.publish_latency_ms is not none %}
 (+{{ t.publish_latency_ms }} ms){% endif %}</td></tr>
<tr><th>failed publish attempts</th><td>{{ t.publish_attempts_failed }}</td></tr>
{% if t.last_publish_error %}<tr><th>last publish error</th><td>{{ t.last_publish_error[:300] }}</td></tr>{% endif %}
{% if t.dead_lettered_at_ms %}<tr><th>relay dead-lettered</th><td>{{ ago(t.dead_lettered_at_ms) }}</td></tr>{% endif %}
</table>
<table class="hops">
<tr><th>consumer or task</th><th>kind</th><th>state</th><th>processed</th><th>after publish</th>
<th>failed deliveries</th><th>dead letters</th><th>last error</th></tr>
{% for h in t.hops %}
<tr data-hop="{{ h.name }}"><td>{{ h.name }}</td><td>{{ h.kind }}</td><td>{{ h.state }}</td>
<td>{{ ago(h.processed_at_ms) }}</td><td>{{ "-" if h.latency_ms is none else h.latency_ms ~ " ms" }}</td>
<td>{{ h.failed_deliveries }}</td>
<td>{% for d in h.dead_letters %}<a href="{{ url_for('outbox_admin.show', dl_id=d.id) }}">{{ d.id }}</a>
{% if d.replayed_at_ms %}(replayed){% endif %} {% else %}-{% endfor %}</td>
<td>{{ (h.last_error or (h.dead_letters[-1].error if h.dead_letters else "") or "-")[:120] }}</td></tr>
{% endfor %}
</table>
{% endfor %}
{% if traces %}<p id="not-recorded">Not recorded, so not shown: {{ not_recorded }}</p>{% endif %}
</body></html>"""

BUTTONS_TEMPLATE = """<form method="post" action="{{ url_for('outbox_admin.replay', dl_id=d.id|string) }}">
<input type="hidden" name="csrf_token" value="{{ csrf }}"><button type="submit" class="replay"
 data-id="{{ d.id }}">Replay</button></form>
<form method="post" action="{{ url_for('outbox_admin.purge', dl_id=d.id|string) }}" class="purge-form"
 data-id="{{ d.id }}">
<input type="hidden" name="csrf_token" value="{{ csrf }}"><button type="submit" class="purge"
 data-id="{{ d.id }}">Purge</button></form>"""


def security_headers(resp: WerkzeugResponse, *, csp: str = CONTENT_SECURITY_POLICY) -> WerkzeugResponse:
    """The headers every admin answer carries; a header the host app already set is kept."""
    resp.headers.setdefault("Content-Security-Policy", csp)
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    resp.headers.setdefault("Referrer-Policy", "no-referrer")
    resp.headers.setdefault("X-Frame-Options", "DENY")
    if request.is_secure:
        resp.headers.setdefault("Strict-Transport-Security", HSTS)
    return resp


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
    ``Origin: null`` on its own forms, which is why Fetch Metadata is asked first; a bare ``null`` is refused."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("Origin") or request.headers.get("Referer")
    if not origin or origin == "null":
        return origin is None
    return urlparse(origin).netloc == request.host


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
    csrf = _csrf_token()
    now = _clock().now_ms()

    def buttons(d: dl.DeadLetter) -> str:
        return render_template_string(BUTTONS_TEMPLATE, d=d, csrf=csrf)

    return render_template_string(
        template, age=lambda d: _human_age(d.age_ms(now)),
        ago=lambda ms: "-" if ms is None else _human_age(max(0, now - ms)) + " ago",
        pretty=_pretty,
        buttons=lambda d: Markup(buttons(d)), **kw,
    )


def make_blueprint() -> Blueprint:
    bp = Blueprint("outbox_admin", __name__, url_prefix="/admin/dead-letters")

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
        return _page(LIST_TEMPLATE, title="Dead letters", items=items, flash=request.args.get("done"),
                     error=request.args.get("error"))

    @bp.get("/groups")
    def groups() -> str:
        found = dl_groups.list_groups(_session(), tables=_outbox().tables)
        return _page(GROUPS_TEMPLATE, title="Dead-letter groups", groups=found, total=sum(g.count for g in found))

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
        return _page(TRACE_TEMPLATE, title="Trace a message", key=key, traces=traces, error=error,
                     not_recorded="; ".join(ops_trace.NOT_RECORDED)), status

    @bp.get("/<dl_id>")
    def show(dl_id: str) -> str:
        try:
            d = dl.get(_session(), dl_id, tables=_outbox().tables)
        except NotFoundError:
            abort(404)
        except OutboxError:
            abort(400)
        return _page(SHOW_TEMPLATE, title=f"Dead letter {d.id}", d=d)

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


def init_app(app: Flask, outbox: Outbox, *, send: dl.Sender | None = None, readiness_path: str | None = "/readyz",
             metrics_path: str | None = "/metrics", broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S) -> None:
    """Mount the dead-letter page (``/admin/dead-letters``, token from ``Settings.admin_token``),
    ``/metrics`` and the readiness probe on any Flask app (a path of None leaves that one out; the
    endpoints are named ``celery_outbox_*`` so they never collide with the app's own); ``send`` replaces
    the Celery sender for replays (tests). Once per app."""
    if EXT in app.extensions:
        raise ConfigError("celery_outbox.contrib.flask.init_app was already called on this Flask app")
    registry = ops_metrics.make_registry(tables=outbox.tables, session_factory=outbox.sessions(), clock=outbox.clock,
                                         queue_probe=queue_probe(outbox, timeout_s=broker_timeout_s))
    app.extensions[EXT] = {"send": send, "registry": registry, "outbox": outbox}
    app.register_blueprint(make_blueprint())
    if readiness_path is not None:
        _mount_readiness(app, outbox, readiness_path, broker_timeout_s)

    def metrics() -> Response:
        resp = Response(ops_metrics.render(registry), 200, {"Content-Type": ops_metrics.CONTENT_TYPE})
        security_headers(resp, csp="default-src 'none'; frame-ancestors 'none'")
        return resp

    if metrics_path is not None:
        app.add_url_rule(metrics_path, endpoint="celery_outbox_metrics", view_func=metrics, methods=["GET"])


def _mount_readiness(app: Flask, outbox: Outbox, path: str, broker_timeout_s: float) -> None:
    """``GET <path>``: 200 when the database answers, the schema is at the library's head revision and
    the broker accepts a connection; else 503 naming the failed checks. The answer is built from check
    names and fixed reasons only (``health.Readiness.public_dict``): no host, port, user or driver text;
    the details go to the server log."""
    probe = broker_probe(outbox.broker_url, timeout_s=broker_timeout_s, settings=outbox.settings)

    def readyz() -> Response:
        result = health.readiness(outbox.sessions(), prefix=outbox.settings.table_prefix, broker=probe)
        resp = Response(json.dumps(result.public_dict(), sort_keys=True), 200 if result.ok else 503,
                        {"Content-Type": "application/json", "Cache-Control": "no-store"})
        if not result.ok:
            current_app.logger.warning("not ready: %s", "; ".join(c.line() for c in result.failed))
            resp.headers["Retry-After"] = "5"
        security_headers(resp, csp="default-src 'none'; frame-ancestors 'none'")
        return resp

    app.add_url_rule(path, endpoint="celery_outbox_readyz", view_func=readyz, methods=["GET"])


# -- the extension ------------------------------------------------------------------------------

EXT_OUTBOX = "celery_outbox"  # app.extensions key of the app's Outbox


def settings_from_config(config: Mapping[str, Any]) -> Settings:
    """``app.config``'s ``OUTBOX_<FIELD>`` keys as explicit arguments: they beat the ``OUTBOX_*``
    environment, which beats the defaults. Text is read as the environment variable would be (``"50"``
    is 50); an ``OUTBOX_`` key naming no setting is refused (a typo would be ignored for ever)."""
    fields = {f"OUTBOX_{f.name.upper()}": f.name for f in dataclasses.fields(Settings)}
    ours = {k: v for k, v in config.items() if isinstance(k, str) and k.startswith("OUTBOX_")}
    unknown = sorted(k for k in ours if k not in fields)
    if unknown:
        raise ConfigError(f"app.config has {', '.join(unknown)[:200]}, which names no outbox setting "
                          f"(known: OUTBOX_NAMESPACE, OUTBOX_DATABASE_URL, ... see docs/settings.md)")
    text = {k: v for k, v in ours.items() if isinstance(v, str)}
    given = {fields[k]: v for k, v in ours.items() if not isinstance(v, str)}
    return Settings.from_env({**os.environ, **text}, **given)


class FlaskOutbox:
    """The Flask extension: ``FlaskOutbox()`` at import, ``init_app(app, db=db)`` in the app factory (module
    docstring). Each app gets its own ``Outbox`` (``app.extensions``); the methods here act on the current app's.

    The verbs are ``Outbox``'s. Declarations (``consumer``, ``task``, ``periodic``, ``route``) can be made at
    import in any module, before any ``init_app``: each is recorded and made on every app's ``Outbox`` when
    ``init_app`` builds it (at once on those already built). ``@outbox.task`` returns a proxy of the task
    (Celery's ``shared_task`` kind): ``.delay()``, ``.s()``, ``.apply()`` act on the current app's task.
    ``publish``, ``cancel``, ``transaction`` and ``enqueue`` take Flask-SQLAlchemy's ``db.session``."""

    def __init__(self, app: Flask | None = None, *, db: Any = None, celery: Celery | None = None) -> None:
        self._db = db
        self._celery = celery
        self._declared: list[Callable[[Outbox], object]] = []
        self._bound: weakref.WeakSet[Outbox] = weakref.WeakSet()  # the apps' outboxes, not kept alive here
        self._tables: Tables | None = None
        self._last: Outbox | None = None
        if app is not None:
            self.init_app(app)

    # -- at import ------------------------------------------------------------------------------
    def _declare(self, make: Callable[[Outbox], object]) -> None:
        """Record a declaration for every app's ``Outbox``; make it now on those ``init_app`` already built."""
        self._declared.append(make)
        for outbox in list(self._bound):
            make(outbox)

    def consumer(self, event: str | Iterable[str], *, name: str, **options: Any) -> Callable[[Handler], ConsumerSpec]:
        """``@outbox.consumer(...)`` as on ``Outbox``: the consumer joins every app's outbox at ``init_app``."""
        make = consumer(name=name, event=event, **options)

        def decorate(handler: Handler) -> ConsumerSpec:
            spec = make(handler)
            self._declare(lambda outbox: outbox.include(spec))
            return spec

        return decorate

    def route(self, event_type: str, *consumers: str) -> None:
        """``Outbox.route``: consumers that live in another service."""
        self._declare(lambda outbox: outbox.route(event_type, *consumers))

    def task(self, consumer_name: str | Callable[..., Any] | None = None, /, *, name: str | None = None,
             **options: Any) -> Any:
        """``Outbox.task``. ``@outbox.task`` / ``@outbox.task(name=..., max_retries=...)`` at import: an
        idempotent task defined on every app's Celery app at ``init_app``; the decorator returns a proxy
        that resolves to the current app's task (outside an app context, the last app's).
        ``outbox.task("billing")``: a proxy of consumer ``billing``'s task."""
        if isinstance(consumer_name, str):
            if name is not None or options:
                raise ConfigError("outbox.task('<consumer>') looks up a consumer's task; to define an idempotent "
                                  "task use @outbox.task(name=..., ...) on a function")
            looked_up = consumer_name
            return Proxy(lambda: self.outbox.task(looked_up))

        def decorate(fn: Callable[..., Any]) -> Any:
            if not callable(fn):
                raise ConfigError(f"@outbox.task decorates a function, got {type(fn).__name__}")
            task_name_ = name if name is not None else f"{fn.__module__}.{fn.__qualname__}"
            self._declare(lambda outbox: outbox.task(name=task_name_, **options)(fn))
            return Proxy(lambda: self.outbox.app.tasks[task_name_])

        return decorate if consumer_name is None else decorate(consumer_name)

    def periodic(self, name: str, task: str, schedule: Any, *, args: Any = (),
                 kwargs: Mapping[str, Any] | None = None, **options: Any) -> None:
        """``Outbox.periodic``: the beat entry goes into every app's Celery configuration at ``init_app``."""
        self._declare(lambda outbox: outbox.periodic(name, task, schedule, args=args, kwargs=kwargs, **options))

    def define_tables(self, metadata: sa.MetaData, *, prefix: str | None = None) -> Tables:
        """Put the library's tables into your ``metadata`` (``OUTBOX_TABLE_PREFIX`` of the environment, or
        ``prefix``); every app's ``OUTBOX_TABLE_PREFIX`` must then agree."""
        if self._tables is not None:
            raise ConfigError("the outbox tables are already defined; call define_tables(metadata) once")
        self._tables = define_tables(metadata, prefix=prefix if prefix is not None else Settings().table_prefix)
        return self._tables

    # -- in the app factory ---------------------------------------------------------------------
    def init_app(self, app: Flask, *, db: Any = None, celery: Celery | None = None, celery_config: bool = True,
                 readiness_path: str | None = "/readyz", metrics_path: str | None = "/metrics",
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S) -> Outbox:
        """Build this app's ``Outbox`` and mount ``/readyz``, ``/metrics``, the dead-letter page and
        ``flask outbox``; returns the ``Outbox``. ``celery_config=False`` leaves the Celery app's
        configuration as it is (else ``recommended_celery_config`` is merged into it)."""
        if EXT_OUTBOX in app.extensions:
            raise ConfigError("FlaskOutbox.init_app was already called on this Flask app")
        settings = settings_from_config(app.config)
        if self._tables is not None and self._tables.prefix != settings.table_prefix:
            raise ConfigError(f"OUTBOX_TABLE_PREFIX is {settings.table_prefix!r} but define_tables() used "
                              f"{self._tables.prefix!r}: give both the same prefix")
        celery_app = celery or self._celery or app.extensions.get("celery") or self._new_celery(app)
        if celery_config:
            celery_app.conf.update(recommended_celery_config(settings))
        database = db if db is not None else self._db
        engine: sa.Engine | None = None
        if database is not None:
            with app.app_context():
                engine = database.engine  # Flask-SQLAlchemy's engine: one pool for the app and the outbox
        outbox = Outbox(celery_app, engine=engine, settings=settings)
        if self._tables is not None:
            outbox._tables = self._tables  # the tables in the team's metadata, one mapping for every app
        for make in self._declared:
            make(outbox)
        outbox.check()
        init_app(app, outbox, readiness_path=readiness_path, metrics_path=metrics_path,
                 broker_timeout_s=broker_timeout_s)
        app.extensions[EXT_OUTBOX] = outbox
        app.cli.add_command(flask_cli(), name="outbox")
        self._last = outbox
        self._bound.add(outbox)
        return outbox

    @staticmethod
    def _new_celery(app: Flask) -> Celery:
        """A Celery app for ``app`` as Flask's Celery guide makes one: configured from ``app.config["CELERY"]``,
        every task run inside ``app.app_context()`` (``db.session`` works in a task), the default app
        (``@shared_task`` binds to it), kept in ``app.extensions["celery"]``."""
        from celery import Task

        class FlaskTask(Task):
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                with app.app_context():
                    return self.run(*args, **kwargs)  # type: ignore[no-untyped-call]

        celery_app = Celery(app.import_name, task_cls=FlaskTask)
        celery_app.config_from_object(dict(app.config.get("CELERY") or {}))
        celery_app.set_default()
        app.extensions["celery"] = celery_app
        return celery_app

    # -- at run time ----------------------------------------------------------------------------
    @property
    def outbox(self) -> Outbox:
        """The current app's ``Outbox`` (outside an app context: the last one ``init_app`` built)."""
        if has_app_context() and EXT_OUTBOX in current_app.extensions:
            found: Outbox = current_app.extensions[EXT_OUTBOX]
            return found
        if self._last is None:
            raise ConfigError("FlaskOutbox.init_app(app) has not run yet")
        return self._last

    def publish(self, session: Any, event: Event) -> Any:
        """``Outbox.publish`` on the current app's outbox (``db.session`` works)."""
        return self.outbox.publish(session, event)

    def cancel(self, session: Any, task_id: str | uuid.UUID) -> Cancelled:
        """``Outbox.cancel`` on the current app's outbox (``db.session`` works)."""
        return self.outbox.cancel(session, task_id)

    @contextmanager
    def transaction(self, session: Any) -> Iterator[Session]:
        """``Outbox.transaction``: inside it ``task.delay()`` becomes a row of ``session`` (``db.session``)."""
        with self.outbox.transaction(session) as bound:
            yield bound

    def enqueue(self, session: Any, signature: Any, **options: Any) -> Any:
        """``Outbox.enqueue`` on the current app's outbox (``db.session`` works)."""
        return self.outbox.enqueue(session, signature, **options)


def flask_cli() -> click.Group:
    """``flask outbox ...``: the ``outbox`` command's commands on the current app's ``Outbox``."""
    from flask.cli import with_appcontext

    from celery_outbox.cli import cli as outbox_cli
    from celery_outbox.cli.common import OutboxGroup

    @click.group(cls=OutboxGroup, help="The transactional outbox of this app (same commands as `outbox`).")
    @with_appcontext
    @click.pass_context
    def group(ctx: click.Context) -> None:
        ctx.obj = {"outbox": current_app.extensions[EXT_OUTBOX]}

    for command in outbox_cli.commands.values():
        group.add_command(command)
    return group
