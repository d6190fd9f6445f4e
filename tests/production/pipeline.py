"""The reference deployment's whole pipeline, run by real processes against a given database URL.

``ChaosEnvironment`` (chaos/environment.py) makes the database, the broker and the processes; here its
processes reach Postgres through ``process_database_url`` (a pooler's URL, a least-privilege role's),
while the checks read the database directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from chaos import invariants
from chaos.environment import ChaosEnvironment
from chaos.load import make_plan


def place_orders(env: ChaosEnvironment, n: int, *, interval_ms: int = 0, rollback: frozenset[int] = frozenset(),
                 name: str = "orders") -> list[str]:
    """Start the order writer on ``n`` planned orders; returns the ids of those planned to roll back."""
    plan = make_plan(n, rollback=rollback)
    env.orders(plan, name=name, interval_ms=interval_ms).start()
    return [str(p["order_id"]) for p in plan if p["rollback"]]


def wait_quiescent(env: ChaosEnvironment, *, committed: int, timeout_s: float, dead_letters: int = 0) -> None:
    """Until ``committed`` orders exist and every consumer and the e-mail task recorded each of them."""
    from orders.models import Order

    def done() -> bool:
        if env.count(Order) < committed:
            return False
        with env.sessions() as s:
            return invariants.quiescent(s, tables=env.tables, consumers=env.consumers,
                                        expected_dead_letters=dead_letters)

    env.wait(done, timeout_s=timeout_s, what=f"{committed} orders' effects")


def check(env: ChaosEnvironment, *, rolled_back: Sequence[str] = (),
          poison: Sequence[tuple[str, str]] = ()) -> invariants.InvariantReport:
    """Every chaos invariant (chaos/invariants.py): each committed order's effects exactly once."""
    with env.sessions() as s:
        return invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=rolled_back,
                                poison=poison)
