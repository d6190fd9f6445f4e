"""``python -m tests.tasks.enqueuer KEY...``: an application process that enqueues through the outbox.

For each key, one transaction: the application's own data (an ``idem_effects`` row of task ``enqueued``),
``idem.record.delay(key)`` and ``plain.record.delay(key)``, committed together; then the
crash point ``after_enqueue_commit`` (armed by ``OUTBOX_CRASH_POINTS``, e.g. ``after_enqueue_commit@2``
dies right after the 2nd commit, before any relay could have published). Settings come from ``OUTBOX_*``.
"""

from __future__ import annotations

import sys

from tests.tasks import idempotent_app as ia

ENQUEUED = "enqueued"


def main(keys: list[str]) -> int:
    built: ia.TaskApp = ia.task_app
    box = built.outbox
    for key in keys:
        with box.sessions().begin() as s, box.transaction(s):
            s.execute(ia.effects.insert().values(task=ENQUEUED, key=key))
            built.record.delay(key)
            built.plain.delay(key)
        box.crash_points.reached("after_enqueue_commit")
        print(f"enqueued {key}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
