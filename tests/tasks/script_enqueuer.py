"""``python -m tests.tasks.script_enqueuer KEY...``: a script (no web request, no open transaction) that enqueues.

For each key, ``idem.record.delay(key)`` then ``plain.record.delay(key)``, each with no transaction open:
in the default mode (``own_transaction``) each row commits in a short transaction of its own inside
``delay()``. After each ``delay()`` returns, the crash point ``after_enqueue_commit`` (armed by
``OUTBOX_CRASH_POINTS``, e.g. ``after_enqueue_commit@3``) may kill the process: between a commit and
any publish. Settings come from ``OUTBOX_*``.
"""

from __future__ import annotations

import sys

from tests.tasks import idempotent_app as ia


def main(keys: list[str]) -> int:
    built: ia.TaskApp = ia.task_app
    for key in keys:
        for task in (built.record, built.plain):
            task.delay(key)
            built.outbox.crash_points.reached("after_enqueue_commit")
        print(f"enqueued {key}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
