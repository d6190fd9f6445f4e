"""The dead letters of both stores in the Django admin (real Postgres, Django's test Client).

Replay and purge go through ``celery_outbox.ops.dead_letters`` (the CLI's functions) via the example
shop's ``Outbox``; consumer replays are sent by a recording fake sender (``use(outbox, send=...)``),
outbox replays are published by the in-memory publisher (``celery_outbox.testing.drain``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from html import unescape
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from django.apps import apps
from django.contrib.admin import helpers
from django.contrib.admin.models import LogEntry
from django.contrib.auth.management import create_permissions
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.test import Client, override_settings
from django.urls import reverse
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, Settings
from celery_outbox.contrib.django import dead_letters as admin_ops
from celery_outbox.contrib.django import use
from celery_outbox.contrib.django.models import ConsumerDeadLetter, OutboxMessage
from celery_outbox.errors import ConfigError
from celery_outbox.inbox import dead_letters as consumer_store
from celery_outbox.schema import Tables
from celery_outbox.testing import drain
from celery_outbox.writer import Event, outbox_values

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONSUMER = "fulfilment"
SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
CONSUMER_LIST = reverse("admin:celery_outbox_consumerdeadletter_changelist")
OUTBOX_LIST = reverse("admin:celery_outbox_outboxmessage_changelist")
Sent = list[tuple[str, dict[str, Any]]]


def consumer_detail(pk: int) -> str:
    return str(reverse("admin:celery_outbox_consumerdeadletter_change", args=[pk]))


def outbox_detail(pk: int) -> str:
    return str(reverse("admin:celery_outbox_outboxmessage_change", args=[pk]))


@pytest.fixture(autouse=True)
def _auth_rows(_empty_tables: None, request: pytest.FixtureRequest) -> None:
    """The conftest empties every table, content types and permissions included: put them back."""
    if request.node.get_closest_marker("django_db") is None:
        return
    ContentType.objects.clear_cache()
    for config in apps.get_app_configs():
        create_permissions(config, verbosity=0)


@pytest.fixture
def sent(shop_outbox: Outbox) -> Iterator[Sent]:
    """The admin replays through the shop's Outbox; consumer replays land here instead of on a broker."""
    box: Sent = []
    use(shop_outbox, send=lambda consumer, envelope: box.append((consumer, envelope)))
    yield box
    use(None)


def login(username: str, *, superuser: bool = False, perms: tuple[str, ...] = ()) -> Client:
    if superuser:
        user = User.objects.create_superuser(username, f"{username}@example.com", "pw")
    else:
        user = User.objects.create_user(username, f"{username}@example.com", "pw", is_staff=True)
        for codename in perms:
            user.user_permissions.add(Permission.objects.get(content_type__app_label="celery_outbox",
                                                             codename=codename))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def root() -> Client:
    return login("root", superuser=True)


def envelope(payload: dict[str, Any] | None = None, *, type: str = "OrderPlaced") -> dict[str, Any]:
    return {"message_id": str(uuid.uuid4()), "type": type, "payload": payload or {"order_id": "o-1", "items": 2},
            "headers": {"correlation_id": "c-1"}, "created_at_ms": 1_700_000_000_000}


def consumer_dead_letter(sessions: sessionmaker[Session], tables: Tables, *, body: str | bytes,
                         consumer: str = CONSUMER, type: str | None = "OrderPlaced", error: str = "boom",
                         message_id: str | None = None) -> int:
    with sessions() as s:
        row = consumer_store.record(
            s, tables=tables, consumer=consumer, message_id=message_id or str(uuid.uuid4()), type=type, body=body,
            headers={"x-note": IMG}, delivery_count=5, last_error=error, first_failed_at_ms=1_700_000_000_000,
            last_failed_at_ms=1_700_000_060_000)
        s.commit()
        return int(row.id)


def outbox_dead_letter(payload: dict[str, Any], *, error: str = "broker nacked it") -> OutboxMessage:
    values = outbox_values(Event("OrderPlaced", payload))
    row: OutboxMessage = OutboxMessage.objects.create(**values)
    OutboxMessage.objects.filter(seq=row.seq).update(attempts=10, dead_lettered_at_ms=1_700_000_100_000,
                                                     last_error=error)
    row.refresh_from_db()
    return row


def act(client: Client, url: str, action: str, pks: list[int], **extra: str) -> Any:
    return client.post(url, {"action": action, "_selected_action": [str(p) for p in pks], **extra}, follow=True)


def html(response: Any) -> str:
    return str(response.content.decode())


def notes(response: Any) -> str:
    """The admin's messages (Django capitalises their first letter), unescaped, lower case, one per line."""
    items = re.findall(r'<ul class="messagelist">(.*?)</ul>', html(response), re.S)
    return "\n".join(unescape(re.sub(r"<[^>]+>", "", m)).strip().lower() for m in items)


# -- listing and showing ----------------------------------------------------------------------------------

def test_the_list_pages_show_the_dead_letters_of_both_stores(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a dead-lettered outbox row, a pending (healthy) one and a consumer dead letter
    dead = outbox_dead_letter({"order_id": "dead-order"})
    pending = OutboxMessage.objects.create(**outbox_values(Event("OrderPlaced", {"order_id": "live-order"})))
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()), error="handler raised KeyError")
    # When the superuser opens both list pages
    outbox_page = root.get(OUTBOX_LIST)
    consumer_page = root.get(CONSUMER_LIST)
    # Then each lists its store's dead letters with id, source, type, message id, count, error and age
    assert outbox_page.status_code == 200 and consumer_page.status_code == 200
    o, c = html(outbox_page), html(consumer_page)
    assert f"outbox:{dead.seq}" in o and str(dead.message_id) in o and "broker nacked it" in o
    assert f"outbox:{pending.seq}" not in o and str(pending.message_id) not in o  # only the dead letters
    assert f"consumer:{cid}" in c and CONSUMER in c and "handler raised KeyError" in c and "OrderPlaced" in c
    assert "Dead-lettered outbox messages" in o and "Consumer dead letters" in c
    # And the consumer page filters by consumer and by replayed state
    assert "?consumer=fulfilment" in c and "?replayed=no" in c
    assert f"consumer:{cid}" not in html(root.get(CONSUMER_LIST + "?replayed=yes"))
    assert f"consumer:{cid}" in html(root.get(CONSUMER_LIST + "?replayed=no&consumer=fulfilment"))


@pytest.mark.parametrize("stored", ["[" * 999 + "]" * 999, '{"n": ' + "7" * 5000 + "}"], ids=["deep", "long-number"])
def test_an_outbox_dead_letter_the_driver_cannot_decode_is_listed_and_shown_as_stored(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables, stored: str) -> None:
    # Given a dead-lettered outbox row written by raw SQL whose payload Python cannot decode (the relay
    # dead-letters such a row), beside an ordinary dead letter
    dead = outbox_dead_letter({"order_id": "dead-order"})
    with sa_sessions() as s:
        seq = s.execute(sa.insert(tables.table(tables.outbox)).values(
            message_id=uuid.uuid4(), type="OrderPlaced", payload={}, headers={}, created_at_ms=0,
            next_attempt_at_ms=0, attempts=0, dead_lettered_at_ms=1_700_000_100_000, last_error="unreadable")
                        .returning(tables.table(tables.outbox).c.seq)).scalar_one()
        s.execute(sa.text(f"UPDATE {tables.table(tables.outbox).name} SET payload = CAST(:p AS jsonb) WHERE seq = :s"),
                  {"p": stored, "s": seq})
        s.commit()
    # When the list and the row's page are opened; Then both answer, the list with both rows, the page with the
    # payload as stored (it was a 500: Django's JSONField decoded every row)
    listed = root.get(OUTBOX_LIST)
    assert listed.status_code == 200 and f"outbox:{seq}" in html(listed) and f"outbox:{dead.seq}" in html(listed)
    page = root.get(outbox_detail(seq))
    assert page.status_code == 200 and stored[:40].replace('"', "&quot;") in html(page)
    assert "dead-order" in html(root.get(outbox_detail(dead.seq)))


def test_a_consumer_dead_letter_is_found_by_the_task_id_flower_shows(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given two consumer dead letters, one kept with the task id of its FAILURE in Flower
    task_id = str(uuid.uuid4())
    with sa_sessions() as s:
        found = consumer_store.record(
            s, tables=tables, consumer=CONSUMER, message_id=str(uuid.uuid4()), type="OrderPlaced",
            body=json.dumps(envelope()), headers={}, delivery_count=3, last_error="carrier down",
            first_failed_at_ms=1_700_000_000_000, last_failed_at_ms=1_700_000_060_000, task_id=task_id).id
        s.commit()
    other = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    # When the operator searches the consumer list for that task id
    page = html(root.get(CONSUMER_LIST, {"q": task_id}))
    # Then only that dead letter is listed, and its page shows the task id
    assert f"consumer:{found}" in page and f"consumer:{other}" not in page
    assert task_id in html(root.get(consumer_detail(found)))


def test_attacker_written_bodies_errors_and_names_are_escaped_everywhere(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given dead letters whose body, error, type, consumer and headers carry HTML
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope({"note": SCRIPT}, type=SCRIPT)),
                               consumer="<b>evil</b>", type=SCRIPT, error=IMG)
    dead = outbox_dead_letter({"note": SCRIPT}, error=IMG)
    # When the list and detail pages are rendered
    pages = [root.get(CONSUMER_LIST), root.get(consumer_detail(cid)), root.get(OUTBOX_LIST),
             root.get(outbox_detail(dead.seq))]
    # Then every page shows the text escaped, never as markup
    for page in pages:
        assert page.status_code == 200
        text = html(page)
        assert SCRIPT not in text and IMG not in text and "<b>evil</b>" not in text
        assert "&lt;img src=x onerror=alert(2)&gt;" in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html(pages[1])  # the pretty-printed body
    assert "&lt;b&gt;evil&lt;/b&gt;" in html(pages[0])  # consumer column and its filter
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html(pages[3])  # the outbox payload


def test_a_base64_stored_body_is_shown_decoded_and_escaped(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a body that was not storable text (invalid UTF-8 and a NUL), so the store kept it as base64
    raw = b"\xff\x00" + SCRIPT.encode()
    cid = consumer_dead_letter(sa_sessions, tables, body=raw)
    assert ConsumerDeadLetter.objects.get(id=cid).body.startswith(consumer_store.BODY_B64_PREFIX)
    # When its detail page is opened
    page = root.get(consumer_detail(cid))
    # Then the decoded text is shown, escaped and printable, with a note on how it was stored
    text = html(page)
    assert page.status_code == 200
    assert "stored base64-encoded" in text
    assert "\\x00&lt;script&gt;alert(1)&lt;/script&gt;" in text and SCRIPT not in text
    assert consumer_store.BODY_B64_PREFIX not in text


def test_the_pages_are_read_only(root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a consumer dead letter
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    # When even a superuser tries to add, edit or delete through Django's own views
    add = root.get(reverse("admin:celery_outbox_consumerdeadletter_add"))
    edit = root.post(consumer_detail(cid), {"consumer": "other", "delivery_count": "0"})
    delete = root.post(reverse("admin:celery_outbox_consumerdeadletter_delete", args=[cid]), {"post": "yes"})
    bulk = act(root, CONSUMER_LIST, "delete_selected", [cid], post="yes")
    # Then nothing changes: no add, no edit, no delete that would bypass the library
    assert add.status_code == 403 and edit.status_code == 403 and delete.status_code == 403
    assert "no action selected" in notes(bulk)
    row = ConsumerDeadLetter.objects.get(id=cid)
    assert row.consumer == CONSUMER and row.delivery_count == 5


def test_an_id_with_blanks_around_it_names_no_dead_letter(root: Client, sa_sessions: sessionmaker[Session],
                                                          tables: Tables) -> None:
    # Given a consumer dead letter and an outbox one
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()), error="consumer-one-error")
    dead = outbox_dead_letter({"order_id": "dead-order"}, error="outbox-one-error")
    for detail, pk, error in ((consumer_detail, cid, "consumer-one-error"), (outbox_detail, dead.seq, "outbox-one-error")):
        assert error in html(root.get(detail(pk)))
        # When its page is opened with blanks around the id (Django's int() would read them as the id)
        for padded in (f"%20{pk}%20", f"{pk}%20", f"%09{pk}"):
            r = root.get(detail(pk).replace(f"/{pk}/", f"/{padded}/"), follow=True)
            # Then the admin says it does not exist, as the CLI and the Flask page refuse it (docs/operations.md)
            assert error not in html(r) and "doesn" in notes(r).replace("\u2019", "'")


@pytest.mark.parametrize("query", ["consumer=%00", "consumer=a%00b", "q=%00", "q=a%00", "replayed=%00", "%00=1"])
def test_a_filter_no_column_can_hold_is_a_400_not_a_500(root: Client, sa_sessions: sessionmaker[Session],
                                                         tables: Tables, query: str) -> None:
    # Given a consumer dead letter
    consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    root.raise_request_exception = False
    # When a list is filtered or searched with NUL (Postgres refuses it in a query)
    for page in (CONSUMER_LIST, OUTBOX_LIST):
        r = root.get(f"{page}?{query}")
        # Then the client's error is a 400, never the 500 of a refused query
        assert r.status_code == 400, (page, query, r.status_code)


@pytest.mark.parametrize("selected", ["", "abc", "1.0", " 1", "\u0661", "9" * 30, "-1"])
@pytest.mark.parametrize("action", ["replay_dead_letters", "purge_dead_letters"])
def test_an_action_on_an_id_that_is_not_one_is_a_400_and_changes_nothing(
        root: Client, sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables, action: str,
        selected: str) -> None:
    # Given a consumer dead letter
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    root.raise_request_exception = False
    # When an action is posted for it and for a value that is no id (Django's action reads ids with int())
    r = root.post(CONSUMER_LIST, {"action": action, helpers.ACTION_CHECKBOX_NAME: [str(cid), selected], "post": "yes"})
    # Then a 400, nothing sent, the dead letter kept and not replayed
    assert r.status_code == 400, r.status_code
    assert sent == [] and ConsumerDeadLetter.objects.get(id=cid).replayed_at_ms is None


# -- replay -------------------------------------------------------------------------------------------

def test_replaying_a_consumer_dead_letter_sends_it_once_and_marks_it(
        root: Client, sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a consumer dead letter of the shop's consumer
    env = envelope()
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(env))
    # When the superuser replays it from the list
    first = act(root, CONSUMER_LIST, "replay_dead_letters", [cid])
    # Then the stored envelope went to its consumer, the row is marked replayed and the action is logged
    assert first.status_code == 200
    assert sent == [(CONSUMER, env)]
    assert ConsumerDeadLetter.objects.get(id=cid).replayed_at_ms is not None
    assert f"consumer:{cid}: replayed: re-sent to consumer 'fulfilment'" in notes(first)
    assert LogEntry.objects.filter(object_id=str(cid), change_message__startswith="Replayed").count() == 1
    # When it is replayed a second time
    second = act(root, CONSUMER_LIST, "replay_dead_letters", [cid])
    # Then nothing is sent again and the page says it was already replayed
    assert sent == [(CONSUMER, env)]
    assert f"consumer:{cid}: skipped: already replayed" in notes(second)


def test_replaying_an_outbox_dead_letter_makes_the_row_pending_for_the_relay(
        root: Client, sent: Sent, shop_outbox: Outbox) -> None:
    # Given an outbox row the relay dead-lettered
    dead = outbox_dead_letter({"order_id": "o-9", "items": 1})
    # When the superuser replays it
    page = act(root, OUTBOX_LIST, "replay_dead_letters", [dead.seq])
    # Then the row is pending again (due now, a fresh attempt budget) and leaves the dead-letter list
    row = OutboxMessage.objects.get(seq=dead.seq)
    assert row.dead_lettered_at_ms is None and row.published_at_ms is None and row.attempts == 0
    assert f"outbox:{dead.seq}: replayed: back in the outbox, due now" in notes(page)
    assert f"outbox:{dead.seq}" not in html(root.get(OUTBOX_LIST))
    # And the relay publishes it (in-memory publisher), with its original message id
    published = drain(shop_outbox).published
    assert [json.loads(m.body)[0][0]["message_id"] for m in published] == [str(dead.message_id)]
    # And a second replay of the same id changes nothing: it is no longer a dead letter, so not selectable
    again = act(root, OUTBOX_LIST, "replay_dead_letters", [dead.seq])
    assert notes(again) == "none of the selected rows is a dead letter (any more); nothing was changed"
    row = OutboxMessage.objects.get(seq=dead.seq)
    assert row.published_at_ms is not None and row.dead_lettered_at_ms is None
    assert sent == []


def test_without_a_test_sender_the_replay_goes_through_the_outbox_celery_app(
        root: Client, shop_outbox: Outbox, sa_sessions: sessionmaker[Session], tables: Tables,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the shop's Outbox registered as in production (no test sender) and its Celery app recording sends
    env = envelope()
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(env))
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(shop_outbox.app, "send_task", lambda name, **kw: calls.append({"name": name, **kw}))
    use(shop_outbox)
    try:
        # When the dead letter is replayed from the admin
        act(root, CONSUMER_LIST, "replay_dead_letters", [cid])
    finally:
        use(None)
    # Then the library's replay sender put the envelope on the consumer's queue of the shop's namespace
    assert [(c["name"], c["args"], c["queue"]) for c in calls] == [("consumers.fulfilment", [env], "shop.fulfilment")]
    assert ConsumerDeadLetter.objects.get(id=cid).replayed_at_ms is not None


def test_a_replay_the_library_refuses_changes_nothing_and_says_why(
        root: Client, sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a replayable dead letter and one whose body never was an envelope
    good = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    bad = consumer_dead_letter(sa_sessions, tables, body="not json <at all>")
    # When both are replayed in one action
    page = act(root, CONSUMER_LIST, "replay_dead_letters", [good, bad])
    # Then the library refuses the batch up front: nothing sent, nothing marked, the reason shown escaped
    assert sent == []
    assert ConsumerDeadLetter.objects.filter(replayed_at_ms__isnull=False).count() == 0
    text = notes(page)
    assert "replay failed" in text and "cannot be replayed" in text and "nothing was changed" in text
    assert "stay replayed" not in text  # a refusal up front is not a half-done batch


def test_without_a_configured_outbox_replay_says_how_to_configure_it(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given no use(outbox) and no OUTBOX_INSTANCE setting
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    use(None)
    with override_settings(OUTBOX_INSTANCE=None):
        # When a replay is attempted
        page = act(root, CONSUMER_LIST, "replay_dead_letters", [cid])
    # Then the page names both ways to configure it and the dead letter is untouched
    assert "celery_outbox.contrib.django.use(outbox)" in notes(page) and "outbox_instance" in notes(page)
    assert ConsumerDeadLetter.objects.get(id=cid).replayed_at_ms is None


def test_the_outbox_instance_setting_is_loaded_lazily_and_checked(shop_outbox: Outbox, django_pg_url: str) -> None:
    # Given no registration
    use(None)
    # Then the example's OUTBOX_INSTANCE names the shop's Outbox
    assert admin_ops.configured() == (shop_outbox, None)
    use(None)
    # And a malformed or wrong setting is a one-line ConfigError, not a traceback deep in the admin
    for bad, words in [("shop_project.celery", "module:attribute"), ("no_such_module_x:outbox", "cannot import"),
                       ("shop_project.celery:app", "is not an Outbox")]:
        with override_settings(OUTBOX_INSTANCE=bad), pytest.raises(ConfigError, match=words) as e:
            admin_ops.configured()
        assert "\n" not in str(e.value)
    # And an Outbox on other tables than the ones the admin lists is refused
    other = Outbox(Celery("other", set_as_current=False),
                   settings=Settings(database_url=django_pg_url, table_prefix="other_"))
    with pytest.raises(ConfigError, match="table prefix"):
        use(other)


# -- purge --------------------------------------------------------------------------------------------

def test_purge_asks_first_then_deletes_from_both_stores(
        root: Client, sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a consumer dead letter and a dead-lettered outbox row
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()), message_id=SCRIPT)
    dead = outbox_dead_letter({"order_id": "o-3"})
    # When purge is chosen
    confirm = act(root, CONSUMER_LIST, "purge_dead_letters", [cid])
    # Then a confirmation page lists what would go, and nothing is deleted yet
    assert confirm.status_code == 200 and f"consumer:{cid}" in html(confirm) and "Yes, purge them" in html(confirm)
    assert ConsumerDeadLetter.objects.filter(id=cid).exists()
    # When it is confirmed (for each store)
    done_c = act(root, CONSUMER_LIST, "purge_dead_letters", [cid], post="yes")
    done_o = act(root, OUTBOX_LIST, "purge_dead_letters", [dead.seq], post="yes")
    # Then both rows are gone, the pages say so, and nothing was sent
    assert not ConsumerDeadLetter.objects.filter(id=cid).exists()
    assert not OutboxMessage.objects.filter(seq=dead.seq).exists()
    assert f"purged 1 dead letter(s): consumer:{cid}" in notes(done_c)
    assert f"purged 1 dead letter(s): outbox:{dead.seq}" in notes(done_o)
    assert sent == []


# -- permissions -----------------------------------------------------------------------------------------

def test_a_staff_user_without_permission_gets_403_and_changes_nothing(
        sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given dead letters in both stores and a staff user with no permission on them
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    dead = outbox_dead_letter({"order_id": "o-4"})
    clerk = login("clerk")
    # When the user opens the pages or posts the actions
    responses = [clerk.get(CONSUMER_LIST), clerk.get(consumer_detail(cid)), clerk.get(OUTBOX_LIST),
                 clerk.get(outbox_detail(dead.seq)),
                 act(clerk, CONSUMER_LIST, "replay_dead_letters", [cid]),
                 act(clerk, CONSUMER_LIST, "purge_dead_letters", [cid], post="yes"),
                 act(clerk, OUTBOX_LIST, "replay_dead_letters", [dead.seq]),
                 act(clerk, OUTBOX_LIST, "purge_dead_letters", [dead.seq], post="yes")]
    # Then every answer is 403 and nothing was sent, replayed or deleted
    assert [r.status_code for r in responses] == [403] * len(responses)
    assert sent == []
    assert ConsumerDeadLetter.objects.get(id=cid).replayed_at_ms is None
    assert OutboxMessage.objects.get(seq=dead.seq).dead_lettered_at_ms is not None


def test_view_permission_shows_the_list_but_replay_needs_change_and_purge_needs_delete(
        sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a consumer dead letter, a viewer (view permission) and an operator (view + change)
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    viewer = login("viewer", perms=("view_consumerdeadletter",))
    operator = login("operator", perms=("view_consumerdeadletter", "change_consumerdeadletter"))
    # When the viewer looks and tries to replay
    listing = viewer.get(CONSUMER_LIST)
    denied = act(viewer, CONSUMER_LIST, "replay_dead_letters", [cid])
    # Then the list is shown without the actions, and the replay is refused
    assert listing.status_code == 200 and f"consumer:{cid}" in html(listing)
    assert "replay_dead_letters" not in html(listing) and "purge_dead_letters" not in html(listing)
    assert denied.status_code == 403 and sent == []
    # When the operator replays and then tries to purge
    replayed = act(operator, CONSUMER_LIST, "replay_dead_letters", [cid])
    purge = act(operator, CONSUMER_LIST, "purge_dead_letters", [cid], post="yes")
    # Then the replay went through and the purge is refused (it needs the delete permission)
    assert replayed.status_code == 200 and len(sent) == 1
    assert purge.status_code == 403 and ConsumerDeadLetter.objects.filter(id=cid).exists()


def test_the_database_being_down_shows_no_database_text(
        root: Client, sent: Sent, sa_sessions: sessionmaker[Session], tables: Tables, shop_outbox: Outbox,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a dead letter and an Outbox whose database connection fails with a detailed driver error
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    monkeypatch.setattr(admin_ops, "configured", lambda: (_Broken(shop_outbox), lambda c, e: sent.append((c, e))))
    # When a replay is attempted
    page = act(root, CONSUMER_LIST, "replay_dead_letters", [cid])
    # Then the page says the database is unavailable, without the driver's text
    assert "replay failed: the database is unavailable" in notes(page) and "stay replayed" in notes(page)
    assert "db.internal" not in html(page) and "secret_sql" not in html(page)
    assert ConsumerDeadLetter.objects.get(id=cid).replayed_at_ms is None and sent == []


class _Broken:
    """An Outbox stand-in whose sessions cannot connect."""

    def __init__(self, outbox: Outbox) -> None:
        self.app, self.tables, self.clock = outbox.app, outbox.tables, outbox.clock
        self.known_consumers = outbox.known_consumers

    def sessions(self) -> Any:
        def factory() -> Any:
            raise sa.exc.OperationalError("SELECT secret_sql", {}, Exception("host db.internal:5432 refused"))
        return factory


def test_a_url_password_a_stored_error_quotes_is_never_shown(
        root: Client, sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given an outbox dead letter whose error (the relay's, kept as written) quotes a URL with its password, and a
    # consumer dead letter whose stored error was written before the store masked them
    secret = "pw-in-an-error-9"
    error = f"ConnectionError: max retries exceeded with url https://api:{secret}@pay.example/v1"
    dead = outbox_dead_letter({"note": "x"}, error=error)
    cid = consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()))
    ConsumerDeadLetter.objects.filter(id=cid).update(last_error=error)
    # When the lists and the detail pages are rendered; Then none shows the password
    for url in (CONSUMER_LIST, consumer_detail(cid), OUTBOX_LIST, outbox_detail(dead.seq)):
        page = root.get(url)
        assert page.status_code == 200 and secret not in html(page), url
