"""Build this deployment's ``Outbox``: its Celery app, its settings, its three consumers, its e-mail task."""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from celery.beat import PersistentScheduler
from sqlalchemy.orm import Session, sessionmaker

import consumers
import orders.tasks
from celery_outbox import Clock, Outbox
from celeryconfig import Settings, celery_config
from devtools.embedded import resolve_broker_url


class HomeScheduler(PersistentScheduler):
    """Celery's persistent beat scheduler, which first makes sure its schedule file can be written.

    ``celery -A relay.app beat`` keeps its schedule under ``Settings.home`` (``var/`` by default), which
    a fresh checkout does not have: the directory of the schedule file (``-s`` included) is created
    here. One that cannot be created or written stops beat with one line naming the path, instead of
    Celery's "corrupted schedule" retry and a traceback printed through its stderr logger one
    character per line.
    """

    def setup_schedule(self) -> None:
        directory = Path(str(self.schedule_filename)).resolve().parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"celery beat: cannot create {directory} for its schedule file: {e.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise SystemExit(f"celery beat: cannot write its schedule file in {directory} (permission denied); "
                             "set OUTBOX_HOME or pass -s to a writable place")
        super().setup_schedule()  # type: ignore[no-untyped-call]


BEAT_SCHEDULER = f"{__name__}:HomeScheduler"


def create_outbox(settings: Settings | None = None, *, broker_url: str | None = None,
                  session_factory: sessionmaker[Session] | None = None, clock: Clock | None = None) -> Outbox:
    settings = settings or Settings.from_env()
    url = broker_url or resolve_broker_url(settings.broker_url, home=settings.home)
    app = Celery("outbox", set_as_current=False)
    app.conf.update(celery_config(settings, url), beat_scheduler=BEAT_SCHEDULER)
    settings = settings.replace(database_url=settings.effective_database_url, broker_url=url)
    outbox = Outbox(app, settings=settings, session_factory=session_factory, clock=clock)
    consumers.register(outbox)
    orders.tasks.register(outbox)
    return outbox


def create_celery_app(settings: Settings | None = None, *, broker_url: str | None = None) -> Celery:
    return create_outbox(settings, broker_url=broker_url).app
