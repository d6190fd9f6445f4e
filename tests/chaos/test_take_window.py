"""The take window, provoked deterministically: messages gone from the broker after their rows were marked.

kombu's Redis transport takes a message (``BRPOP``) before it records it as unacked, so a worker
SIGKILLed between the two leaves its row published and the message nowhere: the broker never
redelivers it. ``ChaosEnvironment.take_and_lose`` leaves exactly that state (``LREM`` before any
worker took it); on RabbitMQ, where such a kill loses nothing, it leaves the nearest one, a message
acknowledged on a raw channel and never processed. Only the reconciler can bring these back, for
events and for the ``@outbox.task`` confirmation e-mail alike.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from chaos import invariants
from chaos.environment import ChaosEnvironment
from chaos.load import make_plan as plan
from devtools.processes import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]


def test_one_orders_four_messages_lost_after_publish_come_back_through_the_reconciler(
        chaos_env: ChaosEnvironment) -> None:
    env = chaos_env
    # Given: one order relayed with no worker running, its three OrderPlaced deliveries and its
    # confirmation e-mail task then taken off the broker, their rows marked published
    loader = env.orders(plan(1))
    loader.start()
    assert loader.wait_exit(timeout_s=60) == 0, env.logs()
    relay = env.relay()
    relay.start()
    env.wait(lambda: env.pending() == 0, what="the order relayed")
    lost = {}
    for delivery in env.deliveries:
        taken = env.take_and_lose(delivery)
        assert taken is not None, f"nothing to take on {delivery}\n{env.logs()}"
        lost[delivery] = taken.message_id
    assert all(n == 0 for n in env.queue_depths().values())
    # When: a worker starts; the relay keeps running with the reconcile window the chaos settings
    # shorten to 12 s (OUTBOX_RELAY_RECONCILE_AFTER_MS)
    env.worker().start()
    pairs = [(invariants.CONFIRMATION_KEY if d == invariants.EMAIL else d, m) for d, m in lost.items()]

    def recorded() -> bool:
        with env.sessions() as s:
            return invariants.quiescent(s, tables=env.tables, consumers=env.consumers, expected_dead_letters=0)

    wait_until(recorded, timeout_s=90)  # the check below names whatever never came back
    # Then: each took effect once (one shipment, invoice, search document, one e-mail), each came back
    # through the reconciler (four re-sends, nothing pending, no dead letter)
    with env.sessions() as s:
        report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[], poison=[],
                                  lost=pairs)
        inbox = {(c, str(m)) for c, m in s.execute(sa.select(env.tables.inbox.consumer,
                                                             env.tables.inbox.message_id)).all()}
    assert report.ok, f"{report.violations}\n{env.logs()}"
    assert report.snapshot.effects == {d: 1 for d in env.deliveries}
    assert set(pairs) <= inbox
    assert report.snapshot.reconciled == len(env.deliveries) == 4
    assert (report.snapshot.reconciled_events, report.snapshot.reconciled_tasks) == (3, 1)
