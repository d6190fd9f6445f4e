"""A database that answers but has no outbox tables (the migrations not run): the beat tasks a worker runs say which
command makes them, in the one line the worker's log shows first."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from celery import Celery

from celery_outbox import Outbox, Settings
from celery_outbox.celery.config import DRAIN_TASK, RECONCILE_TASK


@pytest.mark.parametrize("task", [DRAIN_TASK, RECONCILE_TASK])
def test_a_beat_task_on_a_database_without_the_outbox_tables_names_the_command(tmp_path: Path, task: str) -> None:
    """Given an app whose database has no outbox tables, When beat's drain or reconcile task runs in a worker,
    Then its error is one line that names `outbox db upgrade`: it was the driver's message with its SQL over
    several lines, every second, never saying what to do."""
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    outbox = Outbox(app, settings=Settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}",
                                           namespace=f"mt{uuid.uuid4().hex[:6]}"))
    try:
        result = app.tasks[task].apply()
        assert result.failed()
        message = str(result.result)
        assert "\n" not in message, message
        assert message.endswith("(the outbox tables are missing: run `outbox db upgrade`)"), message
    finally:
        outbox.close()
