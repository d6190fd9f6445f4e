"""The dead letters of both stores in the Django admin, with replay and purge through the library.

Installed with the app: with ``django.contrib.admin`` in ``INSTALLED_APPS``, the admin's autodiscovery
registers two read-only pages on the default site:

* **Outbox messages** (``outbox_messages``), restricted to the rows the relay dead-lettered;
* **Consumer dead letters** (``outbox_dead_letters``), filterable by consumer and replayed state.

Both have two actions, which call ``celery_outbox.ops.dead_letters.replay``/``purge`` (the CLI's and the
Flask page's functions) through the project's ``Outbox`` (see ``celery_outbox.contrib.django.dead_letters``
for ``use(outbox)`` / ``OUTBOX_INSTANCE``):

* **Replay** needs the model's *change* permission: an outbox row goes back to the relay, due now; a
  consumer dead letter is re-sent to its consumer and marked replayed. A second replay is reported as
  skipped, never sent again.
* **Purge** needs the model's *delete* permission and a confirmation page; it deletes for good.

The consumer dead letters' list links two more read-only pages (the model's *view* permission, through
the project's ``Outbox`` like the actions): **Groups** (``outbox dead-letters groups``: dead letters of both
stores grouped by failure, with count, first and last seen and a sample) and **Trace a message**
(``outbox trace``: one message's story, by message id, entity key or correlation id).

Nothing can be added or edited; Django's own "delete selected" is off (it would bypass the library).
Every value shown comes from the stored message, which an attacker may have written: it is only ever
rendered through Django's escaping (``format_html``, autoescaped templates), and bodies are decoded
(``outbox-b64:``) and made printable first. Projects with their own ``AdminSite`` register
``OutboxDeadLetterAdmin`` and ``ConsumerDeadLetterAdmin`` on it themselves.

One module, though long: Django's admin autodiscovery imports the app's ``admin`` module, and the two model
admins share the actions, the escaping and the extra pages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import Model, QuerySet, TextField
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.template import engines
from django.template.backends.django import DjangoTemplates
from django.urls import URLPattern, path
from django.utils.html import format_html
from sqlalchemy import exc as sa_exc

from celery_outbox.config.masking import mask_secrets
from celery_outbox.contrib.django import dead_letters as ops
from celery_outbox.contrib.django.models import ConsumerDeadLetter, OutboxMessage
from celery_outbox.errors import DatabaseError, NotFoundError, OutboxError, PublishError, ValidationError
from celery_outbox.inbox.dead_letters import BODY_B64_PREFIX, body_of
from celery_outbox.messages import DEFAULT_MAX_JSON_DEPTH, decode_json, is_storable, storable_text
from celery_outbox.ops import dead_letter_groups as dl_groups
from celery_outbox.ops import dead_letters as dl
from celery_outbox.ops import trace as ops_trace

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

ERROR_LIST_CHARS = 120
SHOWN_MAX_CHARS = 200_000
SHOWN_JSON_DEPTH = 256  # an outbox row's stored JSON read for a person: deeper than any a writer accepts
CONFIRM_LIST_MAX = 100
REPLAY_ACTION = "replay_dead_letters"
PURGE_ACTION = "purge_dead_letters"

PURGE_CONFIRMATION = """{% extends "admin/base_site.html" %}{% load admin_urls %}
{% block breadcrumbs %}<div class="breadcrumbs"><a href="{% url 'admin:index' %}">Home</a>
&rsaquo; <a href="{% url opts|admin_urlname:'changelist' %}">{{ opts.verbose_name_plural|capfirst }}</a>
&rsaquo; Purge</div>{% endblock %}
{% block content %}
<p>Purge deletes these {{ count }} dead letter(s) for good: they can no longer be replayed.</p>
<ul id="purge-ids">{% for id in shown %}<li>{{ id }}</li>{% endfor %}
{% if more %}<li>... and {{ more }} more</li>{% endif %}</ul>
<form method="post">{% csrf_token %}
{% for pk in pks %}<input type="hidden" name="{{ checkbox }}" value="{{ pk }}">{% endfor %}
<input type="hidden" name="action" value="{{ action }}">
<input type="hidden" name="post" value="yes">
<input type="submit" value="Yes, purge them">
<a href="{% url opts|admin_urlname:'changelist' %}" class="button cancel-link">No, take me back</a>
</form>
{% endblock %}"""


# The consumer dead letters' list with links to the groups and trace pages (Django's object tools).
CHANGE_LIST_WITH_TOOLS = """{% extends "admin/change_list.html" %}
{% block object-tools-items %}<li><a href="{% url groups_url %}" id="dead-letter-groups">Groups</a></li>
<li><a href="{% url trace_url %}" id="trace-a-message">Trace a message</a></li>{{ block.super }}{% endblock %}"""

GROUPS_PAGE = """{% extends "admin/base_site.html" %}{% load admin_urls %}
{% block breadcrumbs %}<div class="breadcrumbs"><a href="{% url 'admin:index' %}">Home</a>
&rsaquo; <a href="{% url opts|admin_urlname:'changelist' %}">{{ opts.verbose_name_plural|capfirst }}</a>
&rsaquo; Groups</div>{% endblock %}
{% block content %}
{% if error %}<p class="errornote" id="error">{{ error }}</p>{% else %}
<p id="count">{{ groups|length }} group(s), {{ total }} dead letter(s)</p>
<table id="groups"><thead><tr><th>group</th><th>count</th><th>source</th><th>consumer</th><th>error</th>
<th>first seen</th><th>last seen</th><th>sample</th></tr></thead><tbody>
{% for g in groups %}<tr data-group="{{ g.id }}"><td>{{ g.id }}</td><td>{{ g.count }}</td><td>{{ g.source }}</td>
<td>{{ g.consumer }}</td><td>{{ g.error }}</td><td>{{ g.first_seen }}</td><td>{{ g.last_seen }}</td>
<td>{{ g.sample_id }}</td></tr>{% endfor %}</tbody></table>
<p>Replay or purge a whole group, throttled and resumable: <code>outbox dead-letters replay --group GROUP</code>,
<code>outbox dead-letters purge --group GROUP --yes --archive FILE</code>.</p>{% endif %}
{% endblock %}"""

TRACE_PAGE = """{% extends "admin/base_site.html" %}{% load admin_urls %}
{% block breadcrumbs %}<div class="breadcrumbs"><a href="{% url 'admin:index' %}">Home</a>
&rsaquo; <a href="{% url opts|admin_urlname:'changelist' %}">{{ opts.verbose_name_plural|capfirst }}</a>
&rsaquo; Trace a message</div>{% endblock %}
{% block content %}
<form method="get"><input name="key" value="{{ key }}" size="50"
 placeholder="message id, entity key (order:42) or correlation id"> <input type="submit" value="Trace"></form>
{% if error %}<p class="errornote" id="error">{{ error }}</p>{% endif %}
{% for t in traces %}
<h2 class="message">{{ t.message_id }} ({{ t.kind }}, {{ t.type|default:"?" }}): {{ t.state }}</h2>
<table class="outbox-hop"><tbody>
<tr><th>entity key / correlation</th><td>{{ t.entity_key|default:"-" }} / {{ t.correlation_id|default:"-" }}</td></tr>
<tr><th>committed at</th><td>{{ t.committed }}</td></tr>
<tr><th>published at</th><td>{{ t.published }}</td></tr>
<tr><th>failed publish attempts</th><td>{{ t.publish_attempts_failed }}</td></tr>
{% if t.last_publish_error %}<tr><th>last publish error</th><td>{{ t.last_publish_error }}</td></tr>{% endif %}
</tbody></table>
<table class="hops"><thead><tr><th>consumer or task</th><th>kind</th><th>state</th><th>processed at</th>
<th>after publish</th><th>failed deliveries</th><th>dead letters</th><th>last error</th></tr></thead><tbody>
{% for h in t.hops %}<tr data-hop="{{ h.name }}"><td>{{ h.name }}</td><td>{{ h.kind }}</td><td>{{ h.state }}</td>
<td>{{ h.processed }}</td><td>{{ h.latency }}</td><td>{{ h.failed_deliveries }}</td><td>{{ h.dead_letters }}</td>
<td>{{ h.error }}</td></tr>{% endfor %}</tbody></table>
{% endfor %}
{% if traces %}<p id="not-recorded">Not recorded, so not shown: {{ not_recorded }}</p>{% endif %}
{% endblock %}"""


def _django_templates() -> DjangoTemplates:
    """The admin requires a DjangoTemplates backend, whatever the project named it."""
    return next(e for e in engines.all() if isinstance(e, DjangoTemplates))


def display(**options: Any) -> Callable[[F], F]:
    """``admin.display``, typed (Django ships no annotations)."""
    decorate: Callable[[F], F] = admin.display(**options)
    return decorate


def action(**options: Any) -> Callable[[F], F]:
    """``admin.action``, typed."""
    decorate: Callable[[F], F] = admin.action(**options)
    return decorate


def shown_text(text: str) -> str:
    """``text`` as a page can hold it: NUL and lone surrogates escaped, cut to ``SHOWN_MAX_CHARS``.
    Still raw text: the caller escapes it for HTML (``format_html``)."""
    return storable_text(text, limit=SHOWN_MAX_CHARS)


def pretty_json(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        return "(nested too deep to show)"


def pretty_body(stored: str) -> str:
    """A consumer dead letter's stored body, decoded (``outbox-b64:``) and pretty-printed when it is JSON."""
    text = body_of(stored)
    try:
        shown = pretty_json(decode_json(text, max_depth=DEFAULT_MAX_JSON_DEPTH, what="body"))
    except OutboxError:
        shown = text
    if stored.startswith(BODY_B64_PREFIX):
        shown = "(stored base64-encoded: the original was not storable text; decoded below)\n" + shown
    return shown_text(shown)


def human_age(ms: int) -> str:
    s = max(0, ms) // 1000
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    return f"{d}d {h}h" if d else f"{h}h {m}m" if h else f"{m}m {s % 60}s" if m else f"{s}s"


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    try:
        return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return str(ms)


def short(text: str | None, limit: int = ERROR_LIST_CHARS) -> str:
    """``text`` on one line, cut, URL passwords masked first (a stored error may quote a URL with its credentials)."""
    one = " ".join(mask_secrets(text or "").split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


def pre(text: str) -> str:
    """``text`` in a <pre>, HTML-escaped by ``format_html`` (the only way markup reaches these pages), URL passwords
    masked."""
    html: str = format_html('<pre style="white-space: pre-wrap; max-height: 40em; overflow: auto">{}</pre>',
                       shown_text(mask_secrets(text)))
    return html


class DeadLetterAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Read-only list and detail pages of one dead-letter store, with replay and purge actions."""

    source: ClassVar[dl.Source]
    title: ClassVar[str]
    actions = [REPLAY_ACTION, PURGE_ACTION]
    list_per_page = 50
    show_full_result_count = False
    search_fields: tuple[str, ...] = ("type",)

    def dead_letter_id(self, obj: Any) -> dl.DeadLetterId:
        return dl.DeadLetterId(source=self.source, row_id=int(obj.pk))

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        """The row of an id written exactly as the list shows it: Django reads the key with ``int()``, which
        would also take blanks around it and other scripts' digits; the ids' one rule (docs/operations.md)
        refuses them, so such a URL is "does not exist"."""
        try:
            dl.DeadLetterId.parse(f"{self.source}:{object_id}")
        except ValidationError:
            return None
        return super().get_object(request, object_id, from_field)

    # -- permissions: nothing is added or edited; replay = change, purge = delete (Django's own) ---
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the detail page is view-only; replaying is an action, not an edit

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # Django's delete would bypass the library; purge is the action

    def _perm(self, action: str) -> str:
        return f"{self.opts.app_label}.{action}_{self.opts.model_name}"

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff and request.user.has_perm(self._perm("change")))

    def has_purge_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff and request.user.has_perm(self._perm("delete")))

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # A filter or search no column can hold (NUL, a lone surrogate) is the client's 400: Postgres refuses
        # the query, which Django would answer with a 500.
        if not all(is_storable(text) for key, values in request.GET.lists() for text in (key, *values)):
            return HttpResponseBadRequest("a filter or search holds NUL or a lone surrogate\n",
                                          content_type="text/plain; charset=utf-8")
        if request.method == "POST":
            # An action the user may not run is a 403, not Django's quiet "No action selected".
            checks: dict[str, Callable[[HttpRequest], bool]] = {
                REPLAY_ACTION: self.has_replay_permission, PURGE_ACTION: self.has_purge_permission}
            for name in request.POST.getlist("action"):
                allowed = checks.get(name)
                if allowed is not None and not allowed(request):
                    raise PermissionDenied
            # Ids as the list writes them, or a 400: Django's action would read them with int() (a 500 on "abc",
            # other scripts' digits taken as numbers); the ids' one rule refuses both (docs/operations.md).
            for raw in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                try:
                    dl.DeadLetterId.parse(f"{self.source}:{raw}")
                except ValidationError:
                    return HttpResponseBadRequest(f"{shown_text(raw)[:80]!r} is not a dead-letter id of this list\n",
                                                  content_type="text/plain; charset=utf-8")
        response: HttpResponse = super().changelist_view(request, {"title": self.title, **(extra_context or {})})
        return response

    # -- list columns ---------------------------------------------------------------------------
    @display(description="id", ordering="pk")
    def dl_id(self, obj: Any) -> str:
        return str(self.dead_letter_id(obj))

    @display(description="source")
    def dl_source(self, obj: Any) -> str:
        return self.source

    @display(description="last error")
    def error_short(self, obj: Any) -> str:
        return short(obj.last_error)

    @display(description="last error")
    def error_full(self, obj: Any) -> str:
        return pre(obj.last_error or "")

    @display(description="headers")
    def headers_pretty(self, obj: Any) -> str:
        return pre(pretty_json(obj.headers))

    def dead_since_ms(self, obj: Any) -> int:
        raise NotImplementedError

    @display(description="age")
    def age(self, obj: Any) -> str:
        return human_age(ops.clock().now_ms() - self.dead_since_ms(obj))

    @display(description="dead-lettered at")
    def dead_at(self, obj: Any) -> str:
        return when(self.dead_since_ms(obj))

    # -- actions --------------------------------------------------------------------------------
    def _failed(self, request: HttpRequest, what: str, error: Exception) -> None:
        if isinstance(error, (DatabaseError, sa_exc.SQLAlchemyError)):
            # the database's text (host, SQL) goes to the server log, not onto the page
            log.warning("admin %s: database error", what, exc_info=True)
            self.message_user(request, f"{what} failed: the database is unavailable; try again shortly",
                              messages.ERROR)
        else:
            self.message_user(request, f"{what} failed: {error}", messages.ERROR)

    def _none_left(self, request: HttpRequest) -> None:
        self.message_user(request, "none of the selected rows is a dead letter (any more); nothing was changed",
                          messages.WARNING)

    @action(description="Replay the selected dead letters", permissions=["replay"])
    def replay_dead_letters(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        objects = {self.dead_letter_id(o): o for o in queryset.order_by("pk")}
        if not objects:  # selected rows that were replayed (outbox) or purged meanwhile
            self._none_left(request)
            return
        try:
            results = ops.replay(list(objects))
        except (OutboxError, sa_exc.SQLAlchemyError) as e:
            self._failed(request, "replay", e)
            if isinstance(e, (PublishError, DatabaseError, sa_exc.SQLAlchemyError)):  # may stop half-way
                self.message_user(request, "dead letters replayed before the error stay replayed; "
                                  "the list shows what is left", messages.WARNING)
            return
        for r in results:
            if r.replayed:
                self.log_change(request, objects[r.id], f"Replayed: {r.detail}")
            self.message_user(request, f"{r.id}: {'replayed' if r.replayed else 'skipped'}: {r.detail}",
                              messages.SUCCESS if r.replayed else messages.WARNING)

    @action(description="Purge the selected dead letters (asks first)", permissions=["purge"])
    def purge_dead_letters(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        objects = list(queryset.order_by("pk"))
        ids = [self.dead_letter_id(o) for o in objects]
        if not ids:
            self._none_left(request)
            return None
        if request.POST.get("post") != "yes":
            return self._confirm_purge(request, objects, ids)
        try:
            n = ops.purge(ids)
        except (OutboxError, sa_exc.SQLAlchemyError) as e:
            self._failed(request, "purge", e)
            return None
        self.log_deletions(request, objects)
        self.message_user(request, f"purged {n} dead letter(s): {short(', '.join(map(str, ids)), 400)}",
                          messages.SUCCESS)
        return None

    def _confirm_purge(self, request: HttpRequest, objects: Sequence[Model], ids: Sequence[dl.DeadLetterId]
                       ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": "Purge dead letters?", "opts": self.opts, "count": len(ids),
            "shown": [str(i) for i in ids[:CONFIRM_LIST_MAX]], "more": max(0, len(ids) - CONFIRM_LIST_MAX),
            "pks": [o.pk for o in objects], "checkbox": helpers.ACTION_CHECKBOX_NAME, "action": PURGE_ACTION,
        }
        request.current_app = self.admin_site.name
        html = _django_templates().from_string(PURGE_CONFIRMATION).render(context, request)
        return HttpResponse(html)


@admin.register(OutboxMessage)
class OutboxDeadLetterAdmin(DeadLetterAdmin):
    """Outbox rows the relay gave up on (``dead_lettered_at_ms`` set). Replay puts one back, due now."""

    source = "outbox"
    title = "Dead-lettered outbox messages"
    list_display = ("dl_id", "dl_source", "consumer", "type", "message_id", "attempts", "error_short", "age")
    list_display_links = ("dl_id",)
    list_filter = ("type",)
    ordering = ("dead_lettered_at_ms", "seq")
    fields = ("dl_id", "dl_source", "message_id", "type", "attempts", "created", "dead_at", "age", "error_full",
              "payload_pretty", "headers_pretty")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxMessage]:
        qs: QuerySet[OutboxMessage] = super().get_queryset(request)
        # the relay's dead letters, nothing else; their JSON is read as text on the detail page (``_stored``)
        return qs.filter(dead_lettered_at_ms__isnull=False).defer("payload", "headers")

    @staticmethod
    def _stored(obj: OutboxMessage, name: str) -> str:
        """A JSON column of ``obj`` read as text and shown decoded when the consumers' decoder reads it, else as
        stored: a row written by raw SQL can hold a value the driver cannot decode (nested past Python's
        recursion limit, a number past its 4300 digits), which the relay dead-letters, and loading it made the
        list and the page a 500."""
        text = (type(obj).objects.filter(pk=obj.pk).annotate(stored_text=Cast(name, TextField()))
                .values_list("stored_text", flat=True).first())
        if text is None:
            return pre("null")
        try:
            return pre(pretty_json(decode_json(text, max_depth=SHOWN_JSON_DEPTH, what=name)))
        except OutboxError:
            return pre(text)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
                           ) -> tuple[QuerySet[Any], bool]:
        found, duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term:
            with contextlib.suppress(ValueError):  # a message id: exact match on the UUID column
                found = found | queryset.filter(message_id=uuid.UUID(term))
        return found, duplicates

    @display(description="consumer")
    def consumer(self, obj: OutboxMessage) -> str:
        return "-"  # the relay gave up before any consumer saw it

    @display(description="created at")
    def created(self, obj: OutboxMessage) -> str:
        return when(obj.created_at_ms)

    @display(description="payload")
    def payload_pretty(self, obj: OutboxMessage) -> str:
        return self._stored(obj, "payload")

    @display(description="headers")
    def headers_pretty(self, obj: Any) -> str:
        return self._stored(obj, "headers")

    def dead_since_ms(self, obj: Any) -> int:
        return int(obj.dead_lettered_at_ms or 0)


class ReplayedFilter(admin.SimpleListFilter):  # type: ignore[misc]
    title = "replayed"
    parameter_name = "replayed"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", "Not replayed"), ("yes", "Replayed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "no":
            return queryset.filter(replayed_at_ms__isnull=True)
        if self.value() == "yes":
            return queryset.filter(replayed_at_ms__isnull=False)
        return queryset


@admin.register(ConsumerDeadLetter)
class ConsumerDeadLetterAdmin(DeadLetterAdmin):
    """Messages a consumer gave up on, kept raw. Replay re-sends one to its consumer, once."""

    source = "consumer"
    title = "Consumer dead letters"
    list_display = ("dl_id", "dl_source", "consumer", "type", "message_id", "deliveries", "error_short", "age",
                    "replayed")
    list_display_links = ("dl_id",)
    list_filter = ("consumer", ReplayedFilter)
    search_fields = ("type", "message_id", "task_id")  # task_id: the FAILURE Flower shows (docs/operations.md)
    ordering = ("last_failed_at_ms", "id")
    fields = ("dl_id", "dl_source", "consumer", "message_id", "task_id", "type", "deliveries", "first_failed", "dead_at", "age",
              "replayed_at", "error_full", "body_pretty", "headers_pretty")
    readonly_fields = fields

    @display(description="deliveries", ordering="delivery_count")
    def deliveries(self, obj: ConsumerDeadLetter) -> int:
        return int(obj.delivery_count)

    @display(description="replayed", boolean=True)
    def replayed(self, obj: ConsumerDeadLetter) -> bool:
        return obj.replayed_at_ms is not None

    @display(description="replayed at")
    def replayed_at(self, obj: ConsumerDeadLetter) -> str:
        return when(obj.replayed_at_ms)

    @display(description="first failed at")
    def first_failed(self, obj: ConsumerDeadLetter) -> str:
        return when(obj.first_failed_at_ms)

    @display(description="body")
    def body_pretty(self, obj: ConsumerDeadLetter) -> str:
        return pre(pretty_body(obj.body))

    def dead_since_ms(self, obj: Any) -> int:
        return int(obj.last_failed_at_ms)

    # -- the groups and trace pages ----------------------------------------------------------------
    def _url_name(self, page: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{page}"

    @property
    def change_list_template(self) -> Any:
        return _django_templates().from_string(CHANGE_LIST_WITH_TOOLS)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        urls = {"groups_url": f"admin:{self._url_name('groups')}", "trace_url": f"admin:{self._url_name('trace')}"}
        return super().changelist_view(request, {**urls, **(extra_context or {})})

    def get_urls(self) -> list[URLPattern]:
        own = [path("groups/", self.admin_site.admin_view(self.groups_view), name=self._url_name("groups")),
               path("trace/", self.admin_site.admin_view(self.trace_view), name=self._url_name("trace"))]
        urls: list[URLPattern] = super().get_urls()
        return own + urls

    def _render(self, request: HttpRequest, page: str, title: str, status: int = 200, **context: Any) -> HttpResponse:
        request.current_app = self.admin_site.name
        html = _django_templates().from_string(page).render(
            {**self.admin_site.each_context(request), "title": title, "opts": self.opts, **context}, request)
        return HttpResponse(html, status=status)

    def groups_view(self, request: HttpRequest) -> HttpResponse:
        """``outbox dead-letters groups``: both stores' dead letters grouped by failure."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            outbox, _send = ops.configured()
            with outbox.sessions()() as session:
                found = dl_groups.list_groups(session, tables=outbox.tables)
        except (DatabaseError, sa_exc.SQLAlchemyError):  # the driver's text (host, SQL) stays in the log
            log.warning("admin: cannot list dead-letter groups", exc_info=True)
            return self._render(request, GROUPS_PAGE, "Dead-letter groups", status=503,
                                error="the database is unavailable")
        except OutboxError as e:  # no Outbox configured: the library's own one-line text
            return self._render(request, GROUPS_PAGE, "Dead-letter groups", status=503, error=str(e))
        now = ops.clock().now_ms()
        rows = [{"id": g.id, "count": g.count, "source": g.source, "consumer": g.consumer,
                 "error": short(f"{g.error_class}: {g.message}" if g.error_class else g.message),
                 "first_seen": f"{human_age(max(0, now - g.first_seen_ms))} ago",
                 "last_seen": f"{human_age(max(0, now - g.last_seen_ms))} ago", "sample_id": g.sample_id}
                for g in found]
        return self._render(request, GROUPS_PAGE, "Dead-letter groups", groups=rows, total=sum(g.count for g in found))

    def trace_view(self, request: HttpRequest) -> HttpResponse:
        """``outbox trace``: one message's story, by message id, entity key or correlation id (``?key=``)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        key = request.GET.get("key", "")
        traces: list[dict[str, Any]] = []
        error, status = None, 200
        if key:
            try:
                outbox, _send = ops.configured()
                with outbox.sessions()() as session:
                    found = ops_trace.trace(session, key, tables=outbox.tables, routes=outbox.routes(),
                                            idempotent_tasks=outbox.idempotent_tasks())
                traces = [_trace_rows(t) for t in found]
            except NotFoundError as e:
                error, status = str(e), 404
            except (DatabaseError, sa_exc.SQLAlchemyError):
                log.warning("admin: cannot trace %r", key, exc_info=True)
                error, status = "the database is unavailable", 503
            except OutboxError as e:  # a key that is no message id or key, no Outbox configured
                error, status = str(e), 400
        return self._render(request, TRACE_PAGE, "Trace a message", status=status, key=key, traces=traces,
                            error=error, not_recorded="; ".join(ops_trace.NOT_RECORDED))



def _trace_rows(t: ops_trace.MessageTrace) -> dict[str, Any]:
    """A ``MessageTrace`` as the trace page's plain strings (the template escapes every one)."""
    published = when(t.published_at_ms)
    if t.publish_latency_ms is not None:
        published += f" (+{t.publish_latency_ms} ms)"
    return {
        "message_id": t.message_id, "kind": t.kind, "type": t.type, "state": t.state, "entity_key": t.entity_key,
        "correlation_id": t.correlation_id, "committed": when(t.created_at_ms), "published": published,
        "publish_attempts_failed": t.publish_attempts_failed, "last_publish_error": short(t.last_publish_error, 300),
        "hops": [{"name": h.name, "kind": h.kind, "state": h.state, "processed": when(h.processed_at_ms),
                  "latency": "-" if h.latency_ms is None else f"{h.latency_ms} ms",
                  "failed_deliveries": h.failed_deliveries,
                  "dead_letters": ", ".join(d.id + (" (replayed)" if d.replayed_at_ms else "") for d in h.dead_letters)
                  or "-",
                  "error": short(h.last_error or (h.dead_letters[-1].error if h.dead_letters else "") or "-")}
                 for h in t.hops],
    }
