"""What must hold after any chaos run, however many processes died: read from the database alone.

1. write side: every committed order has exactly one OrderPlaced outbox row and one confirmation
   e-mail task row (orders/tasks.py), and every row an order; no planned-to-fail order left a row
   anywhere (order, outbox, inbox, effect);
2. relay: nothing pending and nothing dead-lettered by the relay at quiescence;
3. consumers: every committed order has exactly one inbox row and exactly one effect per consumer;
   the e-mail task: one inbox row per task and exactly one confirmation e-mail per order (distinct
   provider keys, however often the provider was called);
4. dead letters are exactly the injected poison (by consumer and message id), nothing else;
5. duplicates: the inbox absorbed at least the duplicates the run injected (counted, reported);
6. taken and lost: every message the run removed from the broker after its row was marked published
   (the take window, chaos/broker.py) was recorded by its consumer or task all the same, which only a
   re-send by the reconciler can do (the count of re-sends is in the snapshot).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.schema import Tables
from consumers.models import Invoice, SearchDocument, SentEmail, Shipment
from orders.models import Order
from orders.tasks import NAME

ORDER_PLACED = "OrderPlaced"
CONFIRMATION = NAME  # the confirmation e-mail task (orders/tasks.py)
EMAIL = "email"
CONFIRMATION_KEY = task_key(CONFIRMATION)  # the inbox ``consumer`` of the e-mail task
RECONCILED = "reconciled"  # the relay's counters of re-sends (celery_outbox/relay/reconcile.py): all kinds,
RECONCILED_EVENTS = "reconciled_events"  # (event, consumer) pairs,
RECONCILED_TASKS = "reconciled_tasks"  # ``@outbox.task`` messages (the confirmation e-mail)


@dataclass(frozen=True, kw_only=True)
class Violation:
    invariant: str
    detail: str


@dataclass(kw_only=True)
class Snapshot:
    """The database's state, summarised; ``check`` turns it into violations."""

    committed_orders: int = 0
    pending: int = 0
    relay_dead_letters: int = 0
    inbox_rows: dict[str, int] = field(default_factory=dict)
    effects: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    duplicates_absorbed: int = 0
    reconciled: int = 0  # messages the reconciler published again, all kinds
    reconciled_events: int = 0  # of which (event, consumer) pairs
    reconciled_tasks: int = 0  # of which @outbox.task messages
    oldest_pending_age_ms: int | None = None
    missing_effects: int = 0  # (committed order, consumer or e-mail) pairs with no effect at all: messages lost
    extra_effects: int = 0  # effects beyond the first for one (order, consumer or e-mail): duplicate effects
    batches: dict[str, int] = field(default_factory=dict)  # batch consumers: batches committed, by consumer
    batched_messages: dict[str, int] = field(default_factory=dict)  # and the messages in them


@dataclass(kw_only=True)
class InvariantReport:
    snapshot: Snapshot
    violations: list[Violation] = field(default_factory=list)
    lost_never_recorded: int = 0  # of the ``lost`` messages checked, those no consumer or task recorded

    @property
    def ok(self) -> bool:
        return not self.violations


def effect_counts_by_order(session: Session, *, tables: Tables) -> dict[str, Counter[str]]:
    """consumer -> order id -> number of effects, from each shipped consumer's own table.

    ``consumers.effects.effect_counts`` gives totals; a chaos run needs them per order, because a
    total can hide one order done twice and another never.
    """
    def grouped(column: Any) -> Counter[str]:
        rows = session.execute(sa.select(column, sa.func.count()).group_by(column)).all()
        return Counter({str(k): int(n) for k, n in rows})

    by_message = confirmation_task_ids(session, tables=tables)
    emails: Counter[str] = Counter()
    for key, n in session.execute(sa.select(SentEmail.idempotency_key, sa.func.count())
                                  .group_by(SentEmail.idempotency_key)).all():
        _, _, mid = str(key).partition(":")
        try:
            order = by_message.get(uuid.UUID(mid), f"?{key}")
        except ValueError:
            order = f"?{key}"
        emails[order] += int(n)
    return {
        "shipping": grouped(Shipment.order_id),
        "billing": grouped(Invoice.order_id),
        "search": grouped(SearchDocument.order_id),
        EMAIL: emails,
    }


def email_provider_calls(session: Session) -> int:
    from consumers.effects import email_provider_calls as calls

    return int(calls(session))


def duplicates_absorbed(session: Session, *, tables: Tables) -> int:
    from consumers.effects import duplicates_absorbed as absorbed

    return int(sum(absorbed(session, tables).values()))


def reconciled(session: Session, *, tables: Tables, name: str = RECONCILED) -> int:
    """How many messages the reconciler has published again, all passes (``name``: all kinds, or one)."""
    return counters.value(session, counters.RELAY, name, tables=tables)


def order_message_ids(session: Session, *, tables: Tables) -> dict[uuid.UUID, str]:
    """OrderPlaced message id -> order id, from the outbox rows."""
    rows = session.execute(sa.select(tables.outbox.message_id, tables.outbox.payload)
                           .where(tables.outbox.type == ORDER_PLACED)).all()
    return {mid: str((payload or {}).get("order_id")) for mid, payload in rows}


def confirmation_task_ids(session: Session, *, tables: Tables) -> dict[uuid.UUID, str]:
    """Confirmation e-mail task id (= its outbox message id) -> order id, from the task rows' arguments."""
    rows = session.execute(sa.select(tables.outbox.message_id, tables.outbox.payload)
                           .where(tables.outbox.type == CONFIRMATION)).all()

    def order_of(payload: Any) -> str:
        body = (payload or {}).get("body") if isinstance(payload, dict) else None
        args = body[0] if isinstance(body, list) and body and isinstance(body[0], list) else []
        return str(args[0]) if args else "?"

    return {mid: order_of(payload) for mid, payload in rows}


def quiescent(session: Session, *, tables: Tables, consumers: Sequence[str], expected_dead_letters: int) -> bool:
    """Nothing left to do: no pending row, every order seen by every consumer, all poison dead."""
    pending = session.execute(sa.select(sa.func.count()).select_from(tables.outbox).where(
        tables.outbox.published_at_ms.is_(None), tables.outbox.dead_lettered_at_ms.is_(None))).scalar_one()
    if pending:
        return False
    def rows(kind: str) -> int:
        return int(session.execute(sa.select(sa.func.count()).select_from(tables.outbox)
                                   .where(tables.outbox.type == kind)).scalar_one())

    def inbox(names: Sequence[str]) -> int:
        return int(session.execute(sa.select(sa.func.count()).select_from(tables.inbox).where(
            tables.inbox.consumer.in_(list(names)))).scalar_one())

    if inbox(consumers) < rows(ORDER_PLACED) * len(consumers) or inbox([CONFIRMATION_KEY]) < rows(CONFIRMATION):
        return False
    dead = session.execute(sa.select(sa.func.count()).select_from(tables.dead_letters)).scalar_one()
    return bool(dead >= expected_dead_letters)


def snapshot(session: Session, *, tables: Tables, consumers: Sequence[str], now_ms: int) -> Snapshot:
    snap = Snapshot()
    snap.committed_orders = session.execute(sa.select(sa.func.count()).select_from(Order)).scalar_one()
    snap.pending = session.execute(sa.select(sa.func.count()).select_from(tables.outbox).where(
        tables.outbox.published_at_ms.is_(None), tables.outbox.dead_lettered_at_ms.is_(None))).scalar_one()
    oldest = session.execute(sa.select(sa.func.min(tables.outbox.created_at_ms)).where(
        tables.outbox.published_at_ms.is_(None), tables.outbox.dead_lettered_at_ms.is_(None))).scalar_one()
    snap.oldest_pending_age_ms = None if oldest is None else max(0, now_ms - int(oldest))
    snap.relay_dead_letters = session.execute(sa.select(sa.func.count()).select_from(tables.outbox).where(
        tables.outbox.dead_lettered_at_ms.is_not(None))).scalar_one()
    for consumer, n in session.execute(sa.select(tables.inbox.consumer, sa.func.count())
                                       .group_by(tables.inbox.consumer)).all():
        snap.inbox_rows[consumer] = int(n)
    counts = effect_counts_by_order(session, tables=tables)
    snap.effects = {c: int(sum(counts.get(c, Counter()).values())) for c in (*consumers, EMAIL)}
    orders = set(session.execute(sa.select(Order.id)).scalars())
    for c in (*consumers, EMAIL):
        per_order = counts.get(c, Counter())
        snap.missing_effects += sum(1 for o in orders if per_order.get(o, 0) == 0)
        snap.extra_effects += sum(n - 1 for n in per_order.values() if n > 1)
    snap.dead_letters = session.execute(sa.select(sa.func.count()).select_from(tables.dead_letters)).scalar_one()
    snap.duplicates_absorbed = duplicates_absorbed(session, tables=tables)
    snap.reconciled = reconciled(session, tables=tables)
    for c in consumers:
        n = counters.value(session, c, counters.BATCHES, tables=tables)
        if n:
            snap.batches[c] = n
            snap.batched_messages[c] = counters.value(session, c, counters.BATCHED_MESSAGES, tables=tables)
    snap.reconciled_events = reconciled(session, tables=tables, name=RECONCILED_EVENTS)
    snap.reconciled_tasks = reconciled(session, tables=tables, name=RECONCILED_TASKS)
    return snap


def _sample(items: Iterable[Any], n: int = 5) -> str:
    items = sorted(map(str, items))
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check(session: Session, *, tables: Tables, consumers: Sequence[str], rolled_back: Iterable[str],
          poison: Iterable[tuple[str, str]], min_duplicates: int = 0, now_ms: int = 0,
          lost: Iterable[tuple[str, str]] = ()) -> InvariantReport:
    """Every invariant of the module docstring; ``poison`` is the injected (consumer, message_id) set,
    ``lost`` the (inbox consumer, message_id) pairs taken from the broker and dropped (the e-mail
    task's inbox consumer is ``CONFIRMATION_KEY``)."""
    snap = snapshot(session, tables=tables, consumers=consumers, now_ms=now_ms)
    report = InvariantReport(snapshot=snap)
    v = report.violations

    orders = set(session.execute(sa.select(Order.id)).scalars())
    by_message = order_message_ids(session, tables=tables)
    rows_per_order = Counter(by_message.values())
    no_row = orders - set(rows_per_order)
    if no_row:
        v.append(Violation(invariant="order has its outbox row",
                           detail=f"{len(no_row)} committed order(s) without an OrderPlaced row: {_sample(no_row)}"))
    many_rows = {o for o, n in rows_per_order.items() if n > 1}
    if many_rows:
        v.append(Violation(invariant="order has its outbox row",
                           detail=f"{len(many_rows)} order(s) with several OrderPlaced rows: {_sample(many_rows)}"))
    orphan_rows = set(rows_per_order) - orders
    if orphan_rows:
        v.append(Violation(invariant="no event without its order",
                           detail=f"{len(orphan_rows)} OrderPlaced row(s) for no committed order: "
                                  f"{_sample(orphan_rows)}"))
    tasks = confirmation_task_ids(session, tables=tables)
    tasks_per_order = Counter(tasks.values())
    wrong_tasks = {o: tasks_per_order.get(o, 0) for o in orders if tasks_per_order.get(o, 0) != 1}
    if wrong_tasks:
        v.append(Violation(invariant="order has its e-mail task",
                           detail=f"{len(wrong_tasks)} committed order(s) without exactly one {CONFIRMATION} row: "
                                  f"{_sample(f'{o}={n}' for o, n in wrong_tasks.items())}"))
    orphan_tasks = set(tasks_per_order) - orders
    if orphan_tasks:
        v.append(Violation(invariant="no event without its order",
                           detail=f"{len(orphan_tasks)} {CONFIRMATION} row(s) for no committed order: "
                                  f"{_sample(orphan_tasks)}"))
    rolled = set(rolled_back)
    leaked = rolled & (orders | set(rows_per_order) | set(tasks_per_order))
    if leaked:
        v.append(Violation(invariant="rolled-back order leaves nothing",
                           detail=f"{len(leaked)} rolled-back order(s) found in orders/outbox: {_sample(leaked)}"))

    if snap.pending:
        v.append(Violation(invariant="relay drained", detail=f"{snap.pending} outbox row(s) still pending"))
    if snap.relay_dead_letters:
        v.append(Violation(invariant="relay dead-letters nothing",
                           detail=f"{snap.relay_dead_letters} outbox row(s) dead-lettered by the relay"))

    inbox: dict[str, set[uuid.UUID]] = {c: set() for c in consumers}
    for mid, consumer in session.execute(sa.select(tables.inbox.message_id, tables.inbox.consumer)).all():
        inbox.setdefault(consumer, set()).add(mid)
    counts = effect_counts_by_order(session, tables=tables)
    for consumer in consumers:
        missing = {by_message[m] for m in by_message if m not in inbox.get(consumer, set())}
        if missing:
            v.append(Violation(invariant=f"{consumer}: every order seen once",
                               detail=f"{len(missing)} order(s) without an inbox row: {_sample(missing)}"))
        per_order = counts.get(consumer, Counter())
        wrong = {o: per_order.get(o, 0) for o in orders if per_order.get(o, 0) != 1}
        if wrong:
            detail = _sample(f"{o}={n}" for o, n in wrong.items())
            v.append(Violation(invariant=f"{consumer}: exactly one effect per order",
                               detail=f"{len(wrong)} order(s) with effects != 1: {detail}"))
        ghosts = (set(per_order) - orders) | (rolled & set(per_order))
        if ghosts:
            v.append(Violation(invariant=f"{consumer}: no effect without a committed order",
                               detail=f"effects for {len(ghosts)} unknown/rolled-back order(s): {_sample(ghosts)}"))

    task_inbox = inbox.get(CONFIRMATION_KEY, set())
    unseen = {o for m, o in tasks.items() if m not in task_inbox}
    if unseen:
        v.append(Violation(invariant=f"{EMAIL}: every order seen once",
                           detail=f"{len(unseen)} e-mail task(s) without an inbox row: {_sample(unseen)}"))
    sent = counts.get(EMAIL, Counter())
    wrong_sent = {o: sent.get(o, 0) for o in orders if sent.get(o, 0) != 1}
    if wrong_sent:
        v.append(Violation(invariant=f"{EMAIL}: exactly one effect per order",
                           detail=f"{len(wrong_sent)} order(s) with confirmation e-mails != 1: "
                                  f"{_sample(f'{o}={n}' for o, n in wrong_sent.items())}"))
    ghosts = (set(sent) - orders) | (rolled & set(sent))
    if ghosts:
        v.append(Violation(invariant=f"{EMAIL}: no effect without a committed order",
                           detail=f"e-mails for {len(ghosts)} unknown/rolled-back order(s): {_sample(ghosts)}"))

    lost_pairs = set(lost)
    if lost_pairs:
        recorded = {(c, str(m)) for c, m in session.execute(
            sa.select(tables.inbox.consumer, tables.inbox.message_id)
            .where(tables.inbox.message_id.in_([uuid.UUID(m) for _, m in lost_pairs]))).all()}
        never = lost_pairs - recorded
        report.lost_never_recorded = len(never)
        if never:
            by_kind = Counter(EMAIL if c == CONFIRMATION_KEY else "event" for c, _ in never)
            v.append(Violation(invariant="taken and lost: re-sent and recorded",
                               detail=f"{len(never)} message(s) lost in the take window never came back "
                                      f"({', '.join(f'{n} {k}' for k, n in sorted(by_kind.items()))}; the "
                                      f"reconciler re-sent {snap.reconciled} in all): "
                                      f"{_sample(f'{c}/{m}' for c, m in never)}"))

    dead = Counter((c, m) for c, m in session.execute(
        sa.select(tables.dead_letters.consumer, tables.dead_letters.message_id)).all())
    expected = set(poison)
    extra = {k for k in dead if k not in expected}
    missing_dead = expected - set(dead)
    twice = {k for k, n in dead.items() if n > 1}
    if extra:
        v.append(Violation(invariant="dead letters are exactly the poison",
                           detail=f"{len(extra)} unexpected dead letter(s): {_sample(extra)}"))
    if missing_dead:
        v.append(Violation(invariant="dead letters are exactly the poison",
                           detail=f"{len(missing_dead)} injected poison message(s) not dead-lettered: "
                                  f"{_sample(missing_dead)}"))
    if twice:
        v.append(Violation(invariant="dead letters are exactly the poison",
                           detail=f"{len(twice)} message(s) dead-lettered more than once: {_sample(twice)}"))
    if snap.duplicates_absorbed < min_duplicates:
        v.append(Violation(invariant="duplicates absorbed and counted",
                           detail=f"injected at least {min_duplicates} duplicate deliveries, the inbox counted "
                                  f"{snap.duplicates_absorbed}"))
    return report
