"""Build this deployment's ``Outbox``: its Celery app, its settings, its three consumers, its e-mail task."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery, bootsteps
from celery.beat import PersistentScheduler
from sqlalchemy.orm import Session, sessionmaker

import consumers
import orders.tasks
from celery_outbox import Clock, Outbox, exit_on_config_error
from celeryconfig import EMBEDDED, Settings, celery_config
from relay.embedded import EmbeddedRedis, resolve_broker_url


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


# Where an app whose embedded broker was not running yet points until something asks for the broker: a
# Redis URL (so the app gets Redis's transport options) on a port nothing listens on.
NOT_STARTED_URL = "redis://127.0.0.1:1/0"


class EmbeddedOnDemandOutbox(Outbox):
    """An Outbox whose embedded broker was not running when it was built: it looks for it again when
    something needs the broker (``broker_url()``: the relay, ``outbox check``, a replay; a worker's or
    beat's start, below) and refuses with the one line of ``resolve_broker_url`` if it still is not.
    Commands that only touch the database (``outbox db upgrade``, ``stats``, ``prune``, ...) never ask.
    """

    def __init__(self, app: Celery, *, home: Path, **kwargs: Any) -> None:
        self.embedded_home = home
        super().__init__(app, **kwargs)

    def broker_url(self) -> str:
        if self.settings.broker_url == NOT_STARTED_URL:
            url = resolve_broker_url(EMBEDDED, home=self.embedded_home)  # ConfigError: start it first
            self.app.conf.broker_url = url
            self.settings = self.settings.replace(broker_url=url)
        return super().broker_url()

    def require_broker(self) -> None:
        """At a worker's or beat's start: the embedded broker found, or ``bad configuration`` and exit 2."""
        with exit_on_config_error():
            self.broker_url()


def create_outbox(settings: Settings | None = None, *, broker_url: str | None = None,
                  session_factory: sessionmaker[Session] | None = None, clock: Clock | None = None,
                  broker_on_demand: bool = False) -> Outbox:
    """This deployment's Outbox. ``broker_on_demand``: an embedded broker that is not running is looked
    for again when the broker is needed (``EmbeddedOnDemandOutbox``), not refused here; for entry
    points whose commands may only touch the database (``relay.app``, which ``outbox`` loads)."""
    settings = settings or Settings.from_env()
    on_demand = (broker_url is None and broker_on_demand and settings.broker_url == EMBEDDED
                 and EmbeddedRedis(data_dir=settings.home / "redis").running_port() is None)
    url = NOT_STARTED_URL if on_demand else broker_url or resolve_broker_url(settings.broker_url, home=settings.home)
    app = Celery("outbox", set_as_current=False)
    app.conf.update(celery_config(settings, url), beat_scheduler=BEAT_SCHEDULER)
    home = settings.home
    settings = settings.replace(database_url=settings.effective_database_url, broker_url=url)
    outbox: Outbox
    if on_demand:
        lazy = EmbeddedOnDemandOutbox(app, home=home, settings=settings, session_factory=session_factory, clock=clock)
        app.steps["worker"].add(_require_broker_step(lazy))
        app.conf.beat_scheduler = _require_broker_scheduler(lazy)
        outbox = lazy
    else:
        outbox = Outbox(app, settings=settings, session_factory=session_factory, clock=clock)
    consumers.register(outbox)
    orders.tasks.register(outbox)
    return outbox


def _require_broker_step(outbox: EmbeddedOnDemandOutbox) -> type[bootsteps.Step]:
    """A worker boot step (before the worker connects): the embedded broker, or one line and exit 2."""

    class RequireBroker(bootsteps.Step):
        def __init__(self, parent: Any, **kwargs: Any) -> None:
            outbox.require_broker()
            super().__init__(parent, **kwargs)  # type: ignore[no-untyped-call]

    return RequireBroker


def _require_broker_scheduler(outbox: EmbeddedOnDemandOutbox) -> type[HomeScheduler]:
    """Beat's scheduler for this app: finds the embedded broker before the schedule is set up."""

    class RequireBrokerScheduler(HomeScheduler):
        def setup_schedule(self) -> None:
            outbox.require_broker()
            super().setup_schedule()

    return RequireBrokerScheduler


def create_celery_app(settings: Settings | None = None, *, broker_url: str | None = None) -> Celery:
    return create_outbox(settings, broker_url=broker_url).app
