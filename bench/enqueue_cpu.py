"""Client CPU per task: ``task.delay()`` inside ``outbox.transaction`` (an outbox row in the caller's commit)
vs plain ``task.delay()`` after the commit, same task body, same business row, real Postgres and a real broker
(RabbitMQ by default, as issue #24 measured). Also the relay's task-specific work per row (building the
broker message from the stored row, ``relay.dispatch.build_messages``, no database, no broker).

The outbox side is the reference deployment's ``Outbox`` (``relay.factory.create_outbox``: its consumers,
e-mail task and Celery configuration); the plain side a Celery app with the same configuration and no
Outbox (``--confirms``: with publisher confirms). CPU is this process's ``time.process_time()`` (user +
system) over a round of N transactions; modes alternate A-B / B-A over the rounds after a warm-up;
medians and the ratio outbox / plain are printed and written to bench/results/enqueue_cpu.json.
Statements per transaction are counted with SQLAlchemy's ``before_cursor_execute``. ``--profile
outbox|plain|capture`` prints a CPU-time cProfile of one mode (capture: ten ``.delay()`` captured and
rolled back, never committed). Nothing asserts on speed.

    .venv/bin/python bench/enqueue_cpu.py [--calls 2000] [--rounds 4] [--broker amqp://guest:guest@127.0.0.1:5672//]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.orm import sessionmaker

from bench._common import fresh_database, write_result
from celery_outbox import make_engine
from celery_outbox.relay.dispatch import ClaimedRow, build_messages

ITEMS = sa.Table("bench_items", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True))
BROKER = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _noop(order_id: str, n: int) -> None:
    """The task body (never run here: only the sends are measured)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--broker", default=BROKER)
    parser.add_argument("--profile", choices=("outbox", "plain", "capture"), default=None)
    parser.add_argument("--confirms", action="store_true", help="plain .delay() with publisher confirms")
    parser.add_argument("--capture", action="store_true",
                        help="also time the capture alone (capture: ten .delay() per rolled-back transaction, per "
                             "delay; capture_pooled: the same with a producer taken from Celery's pool around "
                             "each send, what the capture cost before it stopped taking one)")
    parser.add_argument("--sampler", choices=("cprofile", "pyinstrument"), default="cprofile",
                        help="--profile's profiler: cProfile (deterministic, inflates many small calls) or pyinstrument")
    args = parser.parse_args()
    with fresh_database("outbox_bench_enqcpu") as url:
        from celeryconfig import Settings, celery_config
        from relay.factory import create_outbox

        engine = make_engine(url)
        ITEMS.create(engine)
        sessions = sessionmaker(engine)
        namespace = f"bench{uuid.uuid4().hex[:6]}"
        settings = Settings(database_url=url, broker_url=args.broker, namespace=namespace)
        # The reference deployment's Outbox and Celery configuration (issue #24 measured those).
        outbox = create_outbox(settings, broker_url=args.broker, session_factory=sessions)
        queue = f"{namespace}.bench"
        bench_queue = Queue(queue, Exchange(queue), routing_key=queue, durable=True)
        outbox.app.conf.task_queues = [*outbox.app.conf.task_queues, bench_queue]
        noop = outbox.app.task(name="bench.noop", queue=queue, acks_late=True, ignore_result=True,
                               shared=False)(_noop)
        # Plain Celery: the deployment's configuration, no Outbox; confirms as --confirms says.
        plain_app = Celery("plain", set_as_current=False)
        conf = celery_config(settings, args.broker)
        conf["broker_transport_options"] = {**conf["broker_transport_options"], "confirm_publish": args.confirms}
        conf["task_send_sent_event"] = False  # the relay sends none either
        conf["task_queues"] = [*conf["task_queues"], bench_queue]
        plain_app.conf.update(conf)
        plain_noop = plain_app.task(name="bench.noop", queue=queue, acks_late=True, ignore_result=True,
                                    shared=False)(_noop)

        statements = {"n": 0}

        @sa.event.listens_for(engine, "before_cursor_execute")
        def _count(*_: Any) -> None:
            statements["n"] += 1

        def plain() -> None:
            oid = uuid.uuid4().hex
            with sessions.begin() as s:
                s.execute(ITEMS.insert().values(id=oid))
            plain_noop.delay(oid, 1)  # after the commit: the usual pattern, outside any transaction

        def through_outbox() -> None:
            oid = uuid.uuid4().hex
            with sessions.begin() as s, outbox.transaction(s):
                s.execute(ITEMS.insert().values(id=oid))
                noop.delay(oid, 1)  # an outbox row in the same commit

        def capture() -> None:
            """The ``.delay()`` capture alone: the row built and added, never committed (rolled back)."""
            with sessions() as s, outbox.transaction(s):
                s.connection()
                for _ in range(10):
                    noop.delay("x", 1)
                s.rollback()

        def capture_pooled() -> None:
            """``capture`` with a pooled producer given to each send, as Celery's ``send_task`` takes one."""
            with sessions() as s, outbox.transaction(s):
                s.connection()
                for _ in range(10):
                    with outbox.app.producer_or_acquire() as producer:
                        noop.apply_async(("x", 1), producer=producer)
                s.rollback()

        modes: dict[str, Callable[[], None]] = {"plain": plain, "outbox": through_outbox}
        if args.profile == "capture" or args.capture:
            modes["capture"] = capture
        if args.capture:
            modes["capture_pooled"] = capture_pooled
        for fn in modes.values():  # warm up connections and caches
            for _ in range(200):
                fn()
        per_stmt: dict[str, float] = {}
        for name, fn in modes.items():
            statements["n"] = 0
            for _ in range(100):
                fn()
            per_stmt[name] = statements["n"] / 100

        if args.profile and args.sampler == "pyinstrument":  # a sampling profile: less distorted by call counts
            from pyinstrument import Profiler

            sampler = Profiler(interval=0.0005)
            sampler.start()
            for _ in range(args.calls):
                modes[args.profile]()
            sampler.stop()
            print(sampler.output_text(unicode=False, color=False, show_all=bool(os.environ.get("BENCH_SHOW_ALL"))))
        elif args.profile:  # CPU-time deterministic profile of one mode (cProfile's own overhead inflates it)
            import cProfile
            import pstats

            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            for _ in range(args.calls):
                modes[args.profile]()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(60)

        cpu: dict[str, list[float]] = {m: [] for m in modes}
        wall: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for name in order:
                fn = modes[name]
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(args.calls):
                    fn()
                cpu[name].append((time.process_time() - c0) / args.calls * 1000)
                wall[name].append((time.perf_counter() - w0) / args.calls * 1000)

        # The relay's task-specific work: the broker message of each stored row (no database, no broker).
        table = outbox.tables.table(outbox.tables.outbox)
        with engine.connect() as c:
            rows = [ClaimedRow(seq=seq, message_id=mid, type=t, payload=p, headers=dict(h or {}), created_at_ms=ca,
                               attempts=a)
                    for seq, mid, t, p, h, ca, a in c.execute(sa.select(
                        table.c.seq, table.c.message_id, table.c.type, table.c.payload, table.c.headers,
                        table.c.created_at_ms, table.c.attempts).limit(1000))]
        build: list[float] = []
        for _ in range(5):
            c0 = time.process_time()
            for _ in range(10):
                built = build_messages(rows, {}, namespace, outbox.settings.max_message_bytes)
            build.append((time.process_time() - c0) / (10 * len(rows)) * 1000)
        assert len(built.messages) == len(rows), built.unpublishable

        result = {
            "calls": args.calls, "rounds": args.rounds, "broker": args.broker.split("@")[-1], "plain_confirms": args.confirms,
            "client_cpu_ms_per_task": {m: round(statistics.median(v), 4) for m, v in cpu.items()},
            "client_cpu_ms_per_task_rounds": {m: [round(x, 4) for x in v] for m, v in cpu.items()},
            "wall_ms_per_task": {m: round(statistics.median(v), 4) for m, v in wall.items()},
            "statements_per_transaction": per_stmt,
            "relay_build_message_ms_per_row": round(statistics.median(build), 5),
        }
        ratio = result["client_cpu_ms_per_task"]["outbox"] / result["client_cpu_ms_per_task"]["plain"]
        result["ratio_cpu_outbox_to_plain"] = round(ratio, 3)
        for m in ("capture", "capture_pooled"):  # ten delays per transaction: per delay
            if m in modes:
                result[f"{m}_cpu_ms_per_delay"] = round(result["client_cpu_ms_per_task"][m] / 10, 4)
                print(f"{m}: client CPU {result[f'{m}_cpu_ms_per_delay']:.4f} ms per captured delay()")
        for m in modes:
            print(f"{m:7s} client CPU {result['client_cpu_ms_per_task'][m]:.3f} ms/task  wall "
                  f"{result['wall_ms_per_task'][m]:.3f} ms/task  statements/tx {per_stmt[m]:.1f}")
        print(f"client CPU ratio outbox / plain (median of {args.rounds} interleaved rounds): {ratio:.3f}")
        print(f"relay: build the broker message of a task row: {result['relay_build_message_ms_per_row']:.4f} ms/row")
        write_result("enqueue_cpu", result)
        with plain_app.connection_for_write() as conn:  # the plain sends' messages
            conn.default_channel.queue_delete(queue)
        plain_app.close()
        outbox.app.close()
        engine.dispose()


if __name__ == "__main__":
    main()
