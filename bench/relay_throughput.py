"""Relay throughput at DEFAULT settings, as a ratio against the same Kombu client without the database.

Each round, interleaved, for one queue and for the four-consumer fan-out (one message per (row, consumer)):
  ceiling: ``KombuPublisher.publish_batch`` on the same prebuilt task messages, no database, one confirm
           wait per ``relay_max_in_flight_rows`` rows (the batch the default relay grows to);
  relay:   a fresh ``RelayLoop`` at default settings (adaptive batch, pipelined on Postgres) draining
           N fresh Postgres outbox rows with ``drain_once``.
  kombu_100: the same publisher at 100 rows per confirm wait; ``kombu_100_producer`` the same through
           kombu's ``Producer.publish`` per message (the relay's lean publish off: celery/amqp_wire.py);
  aio_pika: (``--aio-pika``, when it is installed) aio-pika with publisher confirms, the same messages
           (body, headers, properties, persistent, mandatory), 100 rows' publishes awaited together.
Also (``--fanout``): one message per row to a fanout exchange bound to the four queues (the broker
copies) against one message per (row, consumer) to the direct exchange, same client, no database.
Optional ``--batch-sizes``: the sequential ``dispatch_batch`` at fixed sizes, for comparison.
Medians of ``--repeat`` interleaved rounds; prints ratios, writes bench/results/relay_throughput.json.

    .venv/bin/python bench/relay_throughput.py [--rows 3000] [--repeat 3] [--fanout] [--batch-sizes 100,500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from bench._common import fresh_database, write_result
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import Envelope, TaskMessage, celery_task_message
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import Tables, define_tables
from celeryconfig import Settings

CONSUMERS = ("shipping", "billing", "search", "email")


def payload(i: int) -> dict[str, Any]:
    return {"order_id": f"o-{i}", "n": i}


def purge(url: str, names: list[str], *, delete: bool = False, exchanges: tuple[str, ...] = ()) -> None:
    with Connection(url) as conn:
        ch = conn.channel()
        for name in names:
            q = Queue(name, no_declare=True)(ch)
            try:
                q.delete() if delete else q.purge()
            except Exception:  # a queue this run never declared
                ch = conn.channel()
        for exchange in exchanges if delete else ():
            Exchange(exchange)(ch).delete()


def messages_for(settings: Settings, rows: int) -> list[TaskMessage]:
    envs = [Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload=payload(i)) for i in range(rows)]
    return [celery_task_message(e, consumer=c, routing_key=settings.queue_name(c))
            for e in envs for c in settings.consumers]


def publish_all(pub: KombuPublisher, msgs: list[TaskMessage], per_batch: int) -> float:
    pub.publish_batch(msgs[:1])  # connect and declare outside the timing
    start = time.perf_counter()
    for i in range(0, len(msgs), per_batch):
        report = pub.publish_batch(msgs[i:i + per_batch])
        assert not report.rejected, report.rejected
    return time.perf_counter() - start


def ceiling(url: str, settings: Settings, rows: int) -> float:
    """Broker messages per second through the relay's own publisher alone (no database)."""
    msgs = messages_for(settings, rows)
    with KombuPublisher(broker_url=url, settings=settings) as pub:
        elapsed = publish_all(pub, msgs, settings.relay_max_in_flight_rows * len(settings.consumers))
    return len(msgs) / elapsed


def kombu_batch(url: str, settings: Settings, rows: int, *, per_batch_rows: int = 100, lean: bool = True) -> float:
    """Broker messages per second through the relay's publisher, ``per_batch_rows`` rows per confirm wait."""
    msgs = messages_for(settings, rows)
    with KombuPublisher(broker_url=url, settings=settings) as pub:
        if not lean:
            pub.publish_batch(msgs[:1])
            pub._lean = None  # kombu's Producer.publish per message, as before the lean publish
        elapsed = publish_all(pub, msgs, per_batch_rows * len(settings.consumers))
    return len(msgs) / elapsed


def aio_pika_batch(url: str, settings: Settings, rows: int, *, per_batch_rows: int = 100) -> float:
    """Broker messages per second through aio-pika with publisher confirms, 100 rows' publishes awaited together."""
    import asyncio
    import importlib

    aio_pika: Any = importlib.import_module("aio_pika")  # optional: not a dependency of the project

    msgs = messages_for(settings, rows)
    per_batch = per_batch_rows * len(settings.consumers)

    async def run() -> float:
        conn = await aio_pika.connect(url)
        async with conn:
            channel = await conn.channel(publisher_confirms=True)
            exchange = await channel.declare_exchange(settings.exchange_name, aio_pika.ExchangeType.DIRECT,
                                                      durable=True)
            for c in settings.consumers:
                queue = await channel.declare_queue(settings.queue_name(c), durable=True)
                await queue.bind(exchange, routing_key=settings.queue_name(c))

            def message(m: TaskMessage) -> Any:
                return aio_pika.Message(m.body.encode(), headers=m.headers, content_type="application/json",
                                        content_encoding="utf-8", priority=0,
                                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                        correlation_id=m.properties["correlation_id"],
                                        message_id=m.properties["message_id"])

            await exchange.publish(message(msgs[0]), routing_key=msgs[0].routing_key, mandatory=True)
            start = time.perf_counter()
            for i in range(0, len(msgs), per_batch):
                await asyncio.gather(*(exchange.publish(message(m), routing_key=m.routing_key, mandatory=True)
                                       for m in msgs[i:i + per_batch]))
            return time.perf_counter() - start

    return len(msgs) / asyncio.run(run())


def fanout_rows_per_s(url: str, settings: Settings, rows: int, exchange: str) -> float:
    """Rows per second when each row is ONE message to a fanout exchange bound to every consumer queue."""
    msgs = messages_for(settings.replace(routes={"OrderPlaced": settings.consumers[:1]}), rows)
    queue_names = [f"{exchange}.{c}" for c in settings.consumers]
    with KombuPublisher(broker_url=url, exchange_name=exchange, queue_names=queue_names) as pub:
        pub.exchange = Exchange(exchange, type="fanout", durable=True)
        pub.queues = [Queue(q, pub.exchange, routing_key=q, durable=True) for q in queue_names]
        elapsed = publish_all(pub, msgs, settings.relay_max_in_flight_rows)
    return rows / elapsed


def fill(sessions: sessionmaker[Session], tables: Tables, rows: int) -> None:
    now = SystemClock().now_ms()
    with sessions() as s:
        s.execute(sa.delete(tables.outbox))
        s.execute(sa.insert(tables.outbox), [
            {"message_id": uuid.uuid4(), "type": "OrderPlaced", "payload": payload(i), "headers": {},
             "created_at_ms": now, "next_attempt_at_ms": now, "attempts": 0} for i in range(rows)])
        s.commit()


def relay_default(url: str, settings: Settings, sessions: sessionmaker[Session], rows: int, *,
                  tables: Tables) -> tuple[float, float]:
    """(messages/s, rows/s) of a fresh default ``RelayLoop`` draining ``rows`` rows."""
    fill(sessions, tables, rows)
    with KombuPublisher(broker_url=url, settings=settings) as pub:
        pub.publish_batch([])
        loop = RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=pub, listen=False)
        published = 0
        start = time.perf_counter()
        while published < rows:
            result = loop.drain_once()
            assert not result.broker_unavailable and result.failed == 0, result
            published += result.published
        elapsed = time.perf_counter() - start
        loop.close()
    assert published == rows, (published, rows)
    return rows * len(settings.consumers) / elapsed, rows / elapsed


def relay_fixed(url: str, settings: Settings, sessions: sessionmaker[Session], rows: int, batch: int, *,
                tables: Tables) -> tuple[float, float]:
    """(messages/s, rows/s) of the sequential ``dispatch_batch`` at a fixed batch size."""
    fill(sessions, tables, rows)
    clock = SystemClock()
    with KombuPublisher(broker_url=url, settings=settings) as pub:
        pub.publish_batch([])
        published = 0
        start = time.perf_counter()
        while True:
            with sessions() as s:
                r = dispatch_with_settings(s, pub, clock, settings, tables=tables, batch_size=batch)
            assert not r.broker_unavailable and r.failed == 0, r
            published += r.published
            if r.claimed == 0:
                break
        elapsed = time.perf_counter() - start
    assert published == rows, (published, rows)
    return rows * len(settings.consumers) / elapsed, rows / elapsed


def interleave(repeat: int, runs: dict[str, Callable[[], Any]], between: Callable[[], None]) -> dict[str, list[Any]]:
    """Run every measurement once per round, round after round, so machine noise hits all alike."""
    out: dict[str, list[Any]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            out[name].append(run())
            between()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672//")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (medians reported)")
    ap.add_argument("--fanout", action="store_true", help="also measure one message per row to a fanout exchange")
    ap.add_argument("--batch-sizes", default="", help="also the sequential relay at these fixed batch sizes")
    ap.add_argument("--aio-pika", action="store_true", help="also aio-pika with confirms (must be installed)")
    args = ap.parse_args()
    url = args.broker_url
    tag = uuid.uuid4().hex[:6]
    results: dict[str, Any] = {"rows": args.rows, "repeat": args.repeat, "scenarios": []}
    queues: list[str] = []
    exchanges: list[str] = []
    with fresh_database() as db_url:
        engine = make_engine(db_url)
        sessions = make_session_factory(engine)
        try:
            for n_consumers in (1, 4):
                settings = Settings(namespace=f"bench{tag}c{n_consumers}", broker_url=url, database_url=db_url,
                                    routes={"OrderPlaced": CONSUMERS[:n_consumers]})
                tables = define_tables(prefix=settings.table_prefix)
                names = [settings.queue_name(c) for c in settings.consumers]
                queues += names
                exchanges.append(settings.exchange_name)
                runs: dict[str, Callable[[], Any]] = {
                    "ceiling": partial(ceiling, url, settings, args.rows),
                    "relay": partial(relay_default, url, settings, sessions, args.rows, tables=tables),
                    "kombu_100": partial(kombu_batch, url, settings, args.rows),
                    "kombu_100_producer": partial(kombu_batch, url, settings, args.rows, lean=False),
                }
                if args.aio_pika:
                    runs["aio_pika"] = partial(aio_pika_batch, url, settings, args.rows)
                for b in filter(None, args.batch_sizes.split(",")):
                    runs[f"fixed_{int(b)}"] = partial(relay_fixed, url, settings, sessions, args.rows, int(b),
                                                      tables=tables)
                got = interleave(args.repeat, runs, partial(purge, url, names))
                ceil = statistics.median(got["ceiling"])
                msgs_s = statistics.median(r[0] for r in got["relay"])
                row: dict[str, Any] = {
                    "consumers": n_consumers, "messages_per_row": n_consumers,
                    "ceiling_msgs_per_s": round(ceil), "relay_msgs_per_s": round(msgs_s),
                    "relay_rows_per_s": round(statistics.median(r[1] for r in got["relay"])),
                    "ratio": round(msgs_s / ceil, 3), "ceiling_runs": [round(c) for c in got["ceiling"]],
                    "relay_runs": [round(r[0]) for r in got["relay"]],
                    "settings": {"relay_batch_size": settings.relay_batch_size,
                                 "relay_max_in_flight_rows": settings.relay_max_in_flight_rows,
                                 "relay_confirm_mode": settings.relay_confirm_mode},
                }
                print(f"{n_consumers} consumer(s): ceiling {ceil:>7.0f} msg/s  relay (defaults) {msgs_s:>7.0f} msg/s"
                      f"  ratio {msgs_s / ceil:.2f}   runs ceiling {row['ceiling_runs']} relay {row['relay_runs']}",
                      flush=True)
                for name in ("kombu_100", "kombu_100_producer", "aio_pika"):
                    if name in got:
                        other = statistics.median(got[name])
                        row[name + "_msgs_per_s"] = round(other)
                        row["relay_over_" + name] = round(msgs_s / other, 3)
                        print(f"    {name:>18}: {other:>7.0f} msg/s  relay / it {msgs_s / other:.2f}"
                              f"   runs {[round(x) for x in got[name]]}", flush=True)
                for name in runs:
                    if name.startswith("fixed_"):
                        fixed = statistics.median(r[0] for r in got[name])
                        row[name + "_msgs_per_s"] = round(fixed)
                        print(f"    sequential, fixed batch {name[6:]:>5}: {fixed:>7.0f} msg/s  ratio {fixed / ceil:.2f}")
                results["scenarios"].append(row)
            if args.fanout:
                settings = Settings(namespace=f"bench{tag}c4", broker_url=url, database_url=db_url,
                                    routes={"OrderPlaced": CONSUMERS})
                fan = f"bench{tag}fan"
                fan_queues = [f"{fan}.{c}" for c in CONSUMERS]
                queues += fan_queues
                exchanges.append(fan)
                direct_names = [settings.queue_name(c) for c in CONSUMERS]
                got = interleave(args.repeat, {
                    "direct": lambda: ceiling(url, settings, args.rows) / len(CONSUMERS),
                    "fanout": lambda: fanout_rows_per_s(url, settings, args.rows, fan),
                }, lambda: purge(url, direct_names + fan_queues))
                direct, fanout = statistics.median(got["direct"]), statistics.median(got["fanout"])
                results["fanout"] = {"direct_rows_per_s": round(direct), "fanout_rows_per_s": round(fanout),
                                     "fanout_over_direct": round(fanout / direct, 3)}
                print(f"4 consumers, no database: one message per (row, consumer) {direct:>7.0f} rows/s, "
                      f"one message per row to a fanout exchange {fanout:>7.0f} rows/s  (x{fanout / direct:.2f})")
        finally:
            engine.dispose()
            purge(url, queues, delete=True, exchanges=tuple(exchanges))
    write_result("relay_throughput", results)


if __name__ == "__main__":
    main()
