"""One view over both dead-letter stores: outbox rows the relay gave up on, and consumer dead letters.

Ids carry their source (``outbox:42``, ``consumer:7``) so one command never confuses a relay row with
a consumer row. Every batch operation validates all ids before it changes anything: a typo in the
third id leaves the first two untouched.

Progress: ``replay(progress=...)`` / ``replay_all(progress=...)`` call back after each dead letter is
replayed and committed (``ReplayProgress``), so the CLI can render a bar without this module knowing how.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session, defer

from celery_outbox.clock import Clock
from celery_outbox.config.masking import mask_secrets
from celery_outbox.errors import MalformedMessageError, NotFoundError, ValidationError
from celery_outbox.inbox.task_keys import is_task_key
from celery_outbox.messages import decode_json
from celery_outbox.schema import DeadLetterRow, OutboxRow, Tables

Source = Literal["outbox", "consumer"]
SOURCES: tuple[Source, ...] = ("outbox", "consumer")
Sender = Callable[[str, dict[str, Any]], None]
# ASCII digits only, no sign, no leading zero, at most a BigInteger: ``str.isdigit`` and ``int`` also take
# superscript, circled and Arabic-Indic digits (read as another id, or a crash), so the pattern is the whole rule.
_ID = re.compile(r"\A(outbox|consumer):([1-9][0-9]{0,18})\Z", re.ASCII)
MAX_ROW_ID = 2**63 - 1
_SHOWN_DEPTH = 256  # an outbox row's stored JSON read for a person: deeper than any a writer accepts


@dataclass(frozen=True, kw_only=True, order=True)
class DeadLetterId:
    """``outbox:42`` or ``consumer:7``: which store, which row."""

    source: Source
    row_id: int

    def __str__(self) -> str:
        return f"{self.source}:{self.row_id}"

    @classmethod
    def parse(cls, raw: object) -> DeadLetterId:
        """``outbox:<seq>`` / ``consumer:<id>`` with ASCII digits, exactly as ``list`` prints it; anything else
        (surrounding blanks included: one rule in the CLI and both admins, docs/operations.md) is a
        ``ValidationError``."""
        m = _ID.match(raw) if isinstance(raw, str) else None
        if m is None or int(m.group(2)) > MAX_ROW_ID:
            shown = repr(raw)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValidationError(
                f"{shown} is not a dead-letter id; use outbox:<seq> or consumer:<id> (see 'outbox dead-letters list')"
            )
        source: Source = "outbox" if m.group(1) == "outbox" else "consumer"
        return cls(source=source, row_id=int(m.group(2)))


@dataclass(frozen=True, kw_only=True)
class DeadLetter:
    """What a person needs to decide: where it died, when, why, and the message itself."""

    id: DeadLetterId
    consumer: str | None  # None for outbox rows: they died before any consumer saw them
    message_id: str
    type: str | None
    error: str
    attempts: int
    dead_lettered_at_ms: int
    first_failed_at_ms: int
    payload: Any  # decoded JSON where possible, else the raw text
    headers: Any = field(default_factory=dict)  # a JSON object, or what another writer stored instead
    replayed_at_ms: int | None = None
    task_id: str | None = None  # the dead-lettered delivery's Celery task id (its page in Flower); a replay reuses it

    @property
    def source(self) -> Source:
        return self.id.source

    def age_ms(self, now_ms: int) -> int:
        return max(0, now_ms - self.dead_lettered_at_ms)

    def to_dict(self, *, now_ms: int) -> dict[str, Any]:
        return {
            "id": str(self.id),
            "source": self.source,
            "consumer": self.consumer,
            "message_id": self.message_id,
            "type": self.type,
            "error": self.error,
            "attempts": self.attempts,
            "dead_lettered_at_ms": self.dead_lettered_at_ms,
            "first_failed_at_ms": self.first_failed_at_ms,
            "age_ms": self.age_ms(now_ms),
            "replayed_at_ms": self.replayed_at_ms,
            "task_id": self.task_id,
            "payload": self.payload,
            "headers": self.headers,
        }


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    id: DeadLetterId
    replayed: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class ReplayProgress:
    """One dead letter replayed (or skipped) and committed: ``done`` of ``total``."""

    result: ReplayResult
    done: int
    total: int


ReplayCallback = Callable[[ReplayProgress], None]


def _stored_headers(value: Any) -> Any:
    """The row's headers as stored: a JSON object as a dict; anything else (a row another writer stored, which the
    relay dead-letters for it) shown as it is, so one such row never makes the list unreadable."""
    if isinstance(value, Mapping):
        return dict(value)
    return {} if value is None else value


def _outbox_rows(tables: Tables) -> Any:  # a Select of (row, payload text, headers text)
    """Outbox rows with their payload and headers read as text (``_from_outbox`` decodes them): a value the
    driver cannot decode (a row written by raw SQL, nested past Python's recursion limit or holding a number past
    its 4300 digits, which the relay dead-letters for it) made every list of dead letters fail."""
    o = tables.outbox
    table = tables.table(o)
    return (sa.select(o, sa.cast(table.c.payload, sa.Text), sa.cast(table.c.headers, sa.Text))
            .options(defer(o.payload), defer(o.headers)))


def _stored_json(text: str | None) -> Any:
    """A stored JSON value as the consumers' decoder reads it, else its text as stored."""
    if text is None:
        return None
    try:
        return decode_json(text, max_depth=_SHOWN_DEPTH, what="stored value")
    except MalformedMessageError:
        return text


def _from_outbox(row: OutboxRow, payload: str | None, headers: str | None) -> DeadLetter:
    assert row.dead_lettered_at_ms is not None
    return DeadLetter(
        id=DeadLetterId(source="outbox", row_id=row.seq), consumer=None, message_id=str(row.message_id),
        type=row.type, error=mask_secrets(row.last_error or ""), attempts=row.attempts,
        dead_lettered_at_ms=row.dead_lettered_at_ms, first_failed_at_ms=row.created_at_ms,
        payload=_stored_json(payload), headers=_stored_headers(_stored_json(headers)),
    )


def _decode_body(body: str) -> Any:
    """The consumer store keeps the raw body; show the envelope's payload when it is JSON by the consumers' own
    rules (``decode_json``), else the raw text. A body with NaN or Infinity (which ``json.loads`` takes) stays
    text: decoded, it would make ``--json`` print ``NaN``, which is not JSON, and break every parser of it."""
    try:
        data = decode_json(body, what="dead letter body")
    except MalformedMessageError:  # not JSON, not strict JSON, or nested past the limit: show it raw
        return body
    if isinstance(data, dict) and "payload" in data:
        return data["payload"]
    return data


def _from_consumer(row: DeadLetterRow) -> DeadLetter:
    return DeadLetter(
        id=DeadLetterId(source="consumer", row_id=row.id), consumer=row.consumer, message_id=row.message_id,
        type=row.type, error=mask_secrets(row.last_error), attempts=row.delivery_count,
        dead_lettered_at_ms=row.last_failed_at_ms, first_failed_at_ms=row.first_failed_at_ms,
        payload=_decode_body(row.body), headers=_stored_headers(row.headers), replayed_at_ms=row.replayed_at_ms,
        task_id=row.task_id,
    )


def check_consumer(consumer: str | None, known: Iterable[str] | None) -> None:
    """An unknown consumer name is an error, not an empty list: a typo must not look like 'all clear'."""
    if consumer is None or known is None:
        return
    names = tuple(known)
    if consumer not in names:
        raise NotFoundError(f"unknown consumer {consumer!r}; configured consumers: {', '.join(names) or '(none)'}")


def list_dead_letters(session: Session, *, tables: Tables, source: Source | None = None, consumer: str | None = None,
                      known_consumers: Iterable[str] | None = None) -> list[DeadLetter]:
    """Unreplayed dead letters, oldest first. ``consumer`` narrows to that consumer's store (outbox rows
    belong to no consumer, so they are left out when a consumer is named)."""
    if source is not None and source not in SOURCES:
        raise ValidationError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    check_consumer(consumer, known_consumers)
    found: list[DeadLetter] = []
    if source in (None, "outbox") and consumer is None:
        rows = session.execute(
            _outbox_rows(tables).where(tables.outbox.dead_lettered_at_ms.is_not(None)).order_by(tables.outbox.seq))
        found.extend(_from_outbox(row, payload, headers) for row, payload, headers in rows)
    if source in (None, "consumer"):
        stmt = sa.select(tables.dead_letters).where(tables.dead_letters.replayed_at_ms.is_(None))
        if consumer is not None:
            stmt = stmt.where(tables.dead_letters.consumer == consumer)
        found.extend(_from_consumer(r) for r in session.scalars(stmt.order_by(tables.dead_letters.id)))
    found.sort(key=lambda d: (d.dead_lettered_at_ms, d.id))
    return found


def get(session: Session, dl_id: DeadLetterId | str, *, tables: Tables) -> DeadLetter:
    """One dead letter (replayed consumer rows included, so ``show`` works after a replay)."""
    ref = DeadLetterId.parse(dl_id) if isinstance(dl_id, str) else dl_id
    if ref.source == "outbox":
        found = session.execute(_outbox_rows(tables).where(tables.outbox.seq == ref.row_id)).first()
        if found is None or found[0].dead_lettered_at_ms is None:
            state = "does not exist" if found is None else "is not dead-lettered"
            raise NotFoundError(f"{ref}: outbox row {state}")
        return _from_outbox(found[0], found[1], found[2])
    crow = session.get(tables.dead_letters, ref.row_id)
    if crow is None:
        raise NotFoundError(f"{ref}: no such consumer dead letter")
    return _from_consumer(crow)


def parse_ids(raw: Sequence[str]) -> list[DeadLetterId]:
    refs = [DeadLetterId.parse(r) for r in raw]
    if not refs:
        raise ValidationError("name at least one dead-letter id")
    return list(dict.fromkeys(refs))


def _require_all(session: Session, refs: Sequence[DeadLetterId], *, tables: Tables) -> None:
    """Every id must exist in its store before anything is changed."""
    outbox_ids = [r.row_id for r in refs if r.source == "outbox"]
    consumer_ids = [r.row_id for r in refs if r.source == "consumer"]
    have_o = set(session.scalars(sa.select(tables.outbox.seq).where(tables.outbox.seq.in_(outbox_ids)))) \
        if outbox_ids else set()
    have_c = set(session.scalars(sa.select(tables.dead_letters.id).where(tables.dead_letters.id.in_(consumer_ids)))) \
        if consumer_ids else set()
    missing = [str(r) for r in refs
               if (r.source == "outbox" and r.row_id not in have_o)
               or (r.source == "consumer" and r.row_id not in have_c)]
    if missing:
        raise NotFoundError(f"no such dead letter(s): {', '.join(missing)}; nothing was changed")


def _replay_outbox(session: Session, ref: DeadLetterId, now_ms: int, *, tables: Tables) -> ReplayResult:
    """Back into the relay's pending set, due now, with a fresh attempt budget. The message id is kept,
    so if the first publish did reach a consumer, its inbox drops the replay."""
    result = session.execute(
        sa.update(tables.outbox)
        .where(tables.outbox.seq == ref.row_id, tables.outbox.dead_lettered_at_ms.is_not(None))
        .values(dead_lettered_at_ms=None, attempts=0, next_attempt_at_ms=now_ms)
        .execution_options(synchronize_session=False)
    )
    if getattr(result, "rowcount", 0) == 1:
        return ReplayResult(id=ref, replayed=True, detail="back in the outbox, due now")
    return ReplayResult(id=ref, replayed=False, detail="not dead-lettered (already replayed?); left alone")


def _replay_consumer(session: Session, ref: DeadLetterId, *, tables: Tables, send: Sender, clock: Clock,
                     known_consumers: Iterable[str] | None) -> ReplayResult:
    row = session.get(tables.dead_letters, ref.row_id)
    assert row is not None
    if row.replayed_at_ms is not None:
        return ReplayResult(id=ref, replayed=False, detail=f"already replayed at {row.replayed_at_ms}; left alone")
    from celery_outbox.inbox import dead_letters as consumer_dead_letters

    task = is_task_key(row.consumer)  # an idempotent task's: the sender checks the app defines that task
    consumer_dead_letters.replay(session, ref.row_id, tables=tables, send=send, clock=clock,
                                 known_consumers=None if task else known_consumers)
    if task:
        return ReplayResult(id=ref, replayed=True, detail=f"re-sent as task {row.type!r} with its task id")
    if row.task_id and callable(getattr(send, "send_as", None)):
        return ReplayResult(id=ref, replayed=True,
                            detail=f"re-sent to consumer {row.consumer!r} as task {row.task_id} (its Flower page)")
    return ReplayResult(id=ref, replayed=True, detail=f"re-sent to consumer {row.consumer!r}")


def _check_replayable(session: Session, refs: Sequence[DeadLetterId], known: Iterable[str] | None, *, tables: Tables,
                      send: Sender | None = None) -> None:
    """Refuse the whole batch up front if any consumer row could not be re-sent.

    A task dead letter (``inbox.task_keys``) names no consumer: the sender's ``check_task`` (when it has
    one, as ``celery.sender.replay_sender``'s does) says whether the app defines that task."""
    from celery_outbox.inbox.dead_letters import envelope_of

    for ref in refs:
        if ref.source != "consumer":
            continue
        row = session.get(tables.dead_letters, ref.row_id)
        assert row is not None
        if row.replayed_at_ms is not None:
            continue
        try:
            if is_task_key(row.consumer):
                envelope = envelope_of(row)
                check_task = getattr(send, "check_task", None)
                if callable(check_task):
                    check_task(row.consumer, envelope)
                continue
            check_consumer(row.consumer, known)
            envelope_of(row)
        except ValidationError as e:
            raise ValidationError(f"{ref}: {e}; nothing was changed") from None


def replay(session: Session, ids: Sequence[DeadLetterId | str], *, tables: Tables, clock: Clock, send: Sender | None = None,
           known_consumers: Iterable[str] | None = None, progress: ReplayCallback | None = None) -> list[ReplayResult]:
    """Replay each dead letter once. Already-replayed ones are reported, not re-sent; the inbox guards
    anything that slips through twice. Commits after each one, then calls ``progress`` with it."""
    refs = parse_ids([str(i) for i in ids])
    _require_all(session, refs, tables=tables)
    if send is None and any(r.source == "consumer" for r in refs):
        raise ValidationError("replaying a consumer dead letter needs a broker sender")
    known = None if known_consumers is None else tuple(known_consumers)
    _check_replayable(session, refs, known, tables=tables, send=send)
    now = clock.now_ms()
    results: list[ReplayResult] = []
    for ref in refs:
        if ref.source == "outbox":
            results.append(_replay_outbox(session, ref, now, tables=tables))
            session.commit()
        else:
            assert send is not None
            results.append(_replay_consumer(session, ref, tables=tables, send=send, clock=clock, known_consumers=known))
            session.commit()
        if progress is not None:
            progress(ReplayProgress(result=results[-1], done=len(results), total=len(refs)))
    return results


def replay_all(session: Session, *, tables: Tables, clock: Clock, send: Sender | None = None, consumer: str | None = None,
               source: Source | None = None, known_consumers: Iterable[str] | None = None,
               progress: ReplayCallback | None = None) -> list[ReplayResult]:
    known = None if known_consumers is None else tuple(known_consumers)
    refs = [d.id for d in list_dead_letters(session, tables=tables, source=source, consumer=consumer, known_consumers=known)]
    if not refs:
        return []
    return replay(session, refs, tables=tables, clock=clock, send=send, known_consumers=known, progress=progress)


def purge(session: Session, ids: Sequence[DeadLetterId | str], *, tables: Tables) -> int:
    """Delete dead letters for good (a person decided they are not worth delivering). Only
    dead-lettered outbox rows can go: a pending or published row is refused. Commits; returns count."""
    refs = parse_ids([str(i) for i in ids])
    _require_all(session, refs, tables=tables)
    outbox_ids = [r.row_id for r in refs if r.source == "outbox"]
    consumer_ids = [r.row_id for r in refs if r.source == "consumer"]
    if outbox_ids:
        live = session.scalars(
            sa.select(tables.outbox.seq).where(tables.outbox.seq.in_(outbox_ids),
                                               tables.outbox.dead_lettered_at_ms.is_(None))
        ).all()
        if live:
            names = ", ".join(f"outbox:{s}" for s in sorted(live))
            raise ValidationError(f"{names}: not dead-lettered (pending or published), refusing to purge; "
                                  "nothing was changed")
    deleted = 0
    if outbox_ids:
        res = session.execute(sa.delete(tables.outbox).where(tables.outbox.seq.in_(outbox_ids),
                                                             tables.outbox.dead_lettered_at_ms.is_not(None)))
        deleted += int(getattr(res, "rowcount", 0))
    if consumer_ids:
        res = session.execute(sa.delete(tables.dead_letters).where(tables.dead_letters.id.in_(consumer_ids)))
        deleted += int(getattr(res, "rowcount", 0))
    session.commit()
    return deleted
