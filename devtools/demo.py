"""The main job on the embedded default: orders in, events and e-mail tasks out, one effect per consumer
and one confirmation e-mail per order, checked.

Runs a real ``celery worker`` (consumers, the e-mail task, the relay task) and a real ``celery beat`` (schedules the
relay) against the embedded Redis and a SQLite file, places orders through the Flask app, then
provokes the failure this system exists for, a relay that published but died before marking (the
rows are marked pending again, so they are published twice), and shows the inbox absorbing it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.errors import OutboxError
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.schema import Tables, define_tables
from celeryconfig import EMBEDDED, Settings
from consumers.effects import duplicates_absorbed, effect_counts
from devtools.processes import Child, beat, wait_until, worker
from orders import migrate
from orders.models import Order
from orders.service import ORDER_PLACED
from orders.tasks import NAME as CONFIRMATION
from relay.embedded import EmbeddedRedis
from relay.web import create_app

EMAIL = "email"  # the confirmation e-mail task's name in the summary (consumers.effects counts it so)
CONFIRMATION_KEY = task_key(CONFIRMATION)
ROWS_PER_ORDER = 2  # its OrderPlaced event and its confirmation e-mail task


@dataclass(kw_only=True)
class DemoCounts:
    orders: int = 0
    published: int = 0
    pending: int = 0
    dead_lettered: int = 0
    effects: dict[str, int] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class DemoResult:
    expected_orders: int
    expected_duplicates: int
    consumers: tuple[str, ...]
    counts: DemoCounts
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def read_counts(sessions: sessionmaker[Session], *, tables: Tables) -> DemoCounts:
    outbox = tables.outbox
    with sessions() as s:
        def n(stmt: sa.Select[int]) -> int:
            return int(s.scalar(stmt) or 0)

        return DemoCounts(
            orders=n(sa.select(sa.func.count()).select_from(Order)),
            published=n(sa.select(sa.func.count()).where(outbox.published_at_ms.is_not(None))),
            pending=n(sa.select(sa.func.count()).where(outbox.published_at_ms.is_(None),
                                                         outbox.dead_lettered_at_ms.is_(None))),
            dead_lettered=n(sa.select(sa.func.count()).where(outbox.dead_lettered_at_ms.is_not(None))),
            effects=effect_counts(s),
            # the e-mail task's inbox key reads as "email", like the consumers' names
            duplicates={EMAIL if k == CONFIRMATION_KEY else k: v for k, v in duplicates_absorbed(s, tables).items()},
        )


def check(counts: DemoCounts, *, orders: int, duplicates: int, consumers: tuple[str, ...]) -> list[str]:
    """``consumers``: what each order reaches, the OrderPlaced consumers and ``email`` (the e-mail task)."""
    problems = []
    if counts.orders != orders:
        problems.append(f"{counts.orders} orders stored, {orders} placed")
    if counts.published != orders * ROWS_PER_ORDER or counts.pending or counts.dead_lettered:
        problems.append(f"outbox: {counts.published} published, {counts.pending} pending, "
                        f"{counts.dead_lettered} dead-lettered (want {orders * ROWS_PER_ORDER}/0/0)")
    for c in consumers:
        if counts.effects.get(c, 0) != orders:
            problems.append(f"{c}: {counts.effects.get(c, 0)} effects for {orders} orders")
        if counts.duplicates.get(c, 0) != duplicates:
            problems.append(f"{c}: {counts.duplicates.get(c, 0)} duplicates absorbed, {duplicates} provoked")
    return problems


def summary_table(result: DemoResult) -> Table:
    c = result.counts
    table = Table(title="outbox demo", show_lines=False)
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_column("expected", justify="right")
    table.add_row("orders placed", str(c.orders), str(result.expected_orders))
    table.add_row("outbox published", str(c.published), str(result.expected_orders * ROWS_PER_ORDER))
    table.add_row("outbox pending", str(c.pending), "0")
    table.add_row("outbox dead-lettered", str(c.dead_lettered), "0")
    for name in result.consumers:
        table.add_row(f"effects: {name}", str(c.effects.get(name, 0)), str(result.expected_orders))
    for name in result.consumers:
        table.add_row(f"duplicates absorbed: {name}", str(c.duplicates.get(name, 0)),
                      str(result.expected_duplicates))
    return table


@contextlib.contextmanager
def running(children: list[Child]) -> Iterator[list[Child]]:
    try:
        for child in children:
            child.start()
        yield children
    finally:
        for child in reversed(children):
            child.stop()


def run_demo(*, settings: Settings, orders: int, duplicates: int = 5, timeout_s: float = 180.0,
             console: Console | None = None, fresh: bool = True) -> DemoResult:
    """Run the whole demo; never raises for a failed check (the result lists the problems)."""
    console = console or Console()
    run_id = uuid.uuid4().hex[:8]
    # A namespace of its own: queues left over from an earlier run cannot leak into this one.
    settings = settings.replace(namespace=f"demo{run_id}")
    home = settings.home.resolve()
    log_dir = home / "logs" / f"demo-{run_id}"
    if not settings.database_url:
        db_path = home / "demo.db"
        if fresh:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(f"{db_path}{suffix}").unlink()
        settings = settings.replace(database_url=f"sqlite:///{db_path}")
    url = settings.effective_database_url
    console.print(f"[bold]database[/] {url.split('@')[-1]}")
    migrate.upgrade(url)  # the library's tables and the Orders service's
    tables = define_tables(prefix=settings.table_prefix)

    embedded = EmbeddedRedis(data_dir=home / "redis") if settings.broker_url == EMBEDDED else None
    started_embedded = embedded is not None and embedded.running_port() is None
    broker_url = embedded.ensure() if embedded is not None else settings.broker_url
    console.print(f"[bold]broker[/]   {broker_url}" + (" (embedded redis-server, AOF fsync always)"
                                                     if embedded else ""))
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    consumers = (*settings.consumers, EMAIL)  # the e-mail is a task (orders/tasks.py), counted like a consumer
    queues = list(settings.worker_queues)
    children = [
        worker(settings, broker_url=broker_url, log_dir=log_dir, queues=queues,
               concurrency=settings.worker_concurrency),
        beat(settings, broker_url=broker_url, log_dir=log_dir),
    ]
    problems: list[str] = []
    try:
        with running(children):
            console.print(f"[bold]started[/]  celery worker (pid {children[0].proc.pid if children[0].proc else '?'})"
                          f" and celery beat; logs in {log_dir}")
            app = create_app(settings=settings, session_factory=sessions)
            client = app.test_client()
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console, transient=False) as progress:
                placing = progress.add_task("placing orders", total=orders)
                for i in range(orders):
                    r = client.post("/orders", json={
                        "order_id": f"demo-{run_id}-{i:05d}", "customer_id": f"c-{i % 17}",
                        "email": f"customer{i}@example.com", "currency": "EUR",
                        "lines": [{"sku": f"sku-{i % 5}", "quantity": 1 + i % 3, "unit_price_cents": 1250}],
                    })
                    if r.status_code != 201:
                        problems.append(f"POST /orders answered {r.status_code}: {r.get_data(as_text=True)}")
                        break
                    progress.advance(placing)
                want = [f"effects: {c}" for c in consumers]
                tasks = {w: progress.add_task(w, total=orders) for w in want}
                published = progress.add_task("outbox published", total=orders * ROWS_PER_ORDER)

                def settled(dups: int) -> bool:
                    c = read_counts(sessions, tables=tables)
                    progress.update(published, completed=c.published)
                    for name in consumers:
                        progress.update(tasks[f"effects: {name}"], completed=c.effects.get(name, 0))
                    return not check(c, orders=orders, duplicates=dups, consumers=consumers)

                ok = wait_until(lambda: settled(0), timeout_s=timeout_s, interval_s=0.5)
                if ok and duplicates:
                    # Provoke "crash after publish, before mark": the rows go back to pending, so the
                    # relay publishes them a second time; every consumer's inbox and the e-mail task's
                    # must drop them (the first ``duplicates`` events and as many e-mail tasks).
                    with sessions() as s:
                        outbox = tables.outbox
                        seqs = [seq for kind in (ORDER_PLACED, CONFIRMATION) for seq in s.scalars(
                            sa.select(outbox.seq).where(outbox.type == kind).order_by(outbox.seq).limit(duplicates))]
                        s.execute(sa.update(outbox).where(outbox.seq.in_(seqs)).values(published_at_ms=None))
                        s.commit()
                    console.print(f"[bold]provoked[/] {len(seqs)} rows (events and e-mail tasks) published twice "
                                  "(relay died after publish, before mark)")
                    wait_until(lambda: settled(duplicates), timeout_s=timeout_s, interval_s=0.5)
            for child in children:
                if not child.alive:
                    problems.append(f"{child.name} exited early:\n{child.log_tail()}")
    except OutboxError as e:
        problems.append(str(e))
    finally:
        counts = read_counts(sessions, tables=tables)
        engine.dispose()
        if started_embedded and embedded is not None:
            embedded.stop()
    problems = check(counts, orders=orders, duplicates=duplicates, consumers=consumers) + problems
    result = DemoResult(expected_orders=orders, expected_duplicates=duplicates, consumers=consumers,
                        counts=counts, problems=problems)
    console.print(summary_table(result))
    if result.ok:
        console.print("[bold green]every count adds up[/]: effectively once, under a provoked duplicate")
    else:
        for p in problems:
            console.print(f"[bold red]problem[/] {p}")
    return result
