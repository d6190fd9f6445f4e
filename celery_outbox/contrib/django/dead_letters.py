"""The Django admin's way to the library's dead-letter operations: which ``Outbox`` replays, and how.

Replay and purge are ``celery_outbox.ops.dead_letters.replay``/``purge``, the functions the CLI
(``outbox dead-letters replay``) and the Flask page call, on a SQLAlchemy session of the project's
``Outbox``: one idempotent implementation, whatever the button. A consumer replay is sent through
``celery_outbox.celery.sender.replay_sender(outbox.app, outbox)`` (the consumer's own queue, task id
derived from message id and consumer, as the relay does).

The admin finds the ``Outbox`` (first match wins):

1. ``celery_outbox.contrib.django.use(outbox)``, called where the ``Outbox`` is built (``proj/celery.py``);
2. the Django setting ``OUTBOX_INSTANCE = "proj.celery:outbox"`` (``module:attribute``), imported on
   the first replay or purge, never at start-up.

Without either, the dead letters are still listed (the lists read Django's models), and a replay or
purge says how to configure it. This module imports no models, so it is safe to import before the
app registry is ready. The registration is its one declared global (``REGISTRATION``).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from celery_outbox.clock import Clock, SystemClock
from celery_outbox.errors import ConfigError
from celery_outbox.ops import dead_letters as dl

if TYPE_CHECKING:
    from celery_outbox.outbox import Outbox

SETTING = "OUTBOX_INSTANCE"
"""The Django setting naming the project's ``Outbox`` as ``"module:attribute"``. Not ``CELERY_...``:
``app.config_from_object("django.conf:settings", namespace="CELERY")`` would read that as a Celery setting."""

class Registration:
    """The ``Outbox`` the admin acts through in this process, and the test sender of consumer replays.
    One per process (``REGISTRATION``); every thread (the admin's request threads) sees the same one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outbox: Outbox | None = None
        self.send: dl.Sender | None = None


REGISTRATION = Registration()
"""This process's one registration: the Django contrib's only process-wide state, declared here as Celery's
``celery._state`` declares the current app (the library keeps no other module-level mutable state). There
before the settings are read, so before ``proj/celery.py`` builds the ``DjangoOutbox`` and calls ``use()``."""


def registration() -> Registration:
    """This process's ``Registration`` (``REGISTRATION``)."""
    return REGISTRATION


def use(outbox: Outbox | None, *, send: dl.Sender | None = None) -> None:
    """Make ``outbox`` the one the admin replays and purges through (the last call wins).

    ``send(consumer, envelope)`` replaces the Celery sender of consumer replays (tests); ``use(None)``
    forgets the registration (then ``OUTBOX_INSTANCE`` applies again).
    """
    if outbox is not None:
        check_tables(outbox)
    reg = registration()
    with reg.lock:
        reg.outbox = outbox
        reg.send = send if outbox is not None else None


def check_tables(outbox: Outbox) -> None:
    """The admin lists Django's models, which are the default-prefix tables; the replay must change those."""
    from celery_outbox.schema import define_tables

    expected = define_tables().names()
    if outbox.tables.names() != expected:
        raise ConfigError(
            f"the Django admin lists the tables {', '.join(expected)}, but this Outbox uses the table prefix "
            f"{outbox.settings.table_prefix!r}; use the default prefix with celery_outbox.contrib.django"
        )


def load(spec: object) -> Outbox:
    """``"module:attribute"`` -> that ``Outbox``; anything else is a one-line ``ConfigError``."""
    from celery_outbox.outbox import Outbox

    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(f"settings.{SETTING} must be 'module:attribute' (e.g. 'proj.celery:outbox'), got {spec!r}")
    module_name, attr = spec.split(":")
    if not all(p.isidentifier() for p in module_name.split(".")) or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(f"settings.{SETTING} must be 'module:attribute' (e.g. 'proj.celery:outbox'), got {spec!r}")
    try:
        found: object = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"settings.{SETTING} = {spec!r}: cannot import {e.name!r}") from None
    for part in attr.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, Outbox):
        raise ConfigError(f"settings.{SETTING} = {spec!r} is not an Outbox (it is {type(found).__name__})")
    check_tables(found)
    return found


def registered() -> Outbox | None:
    """The ``Outbox`` given to ``use()`` (``DjangoOutbox`` calls it), or None; never imports anything."""
    reg = registration()
    with reg.lock:
        return reg.outbox


def configured() -> tuple[Outbox, dl.Sender | None]:
    """The ``Outbox`` (and the test sender, if any) the admin acts through; ``ConfigError`` if there is none."""
    from django.conf import settings

    reg = registration()
    with reg.lock:
        if reg.outbox is not None:
            return reg.outbox, reg.send
    spec = getattr(settings, SETTING, None)
    if spec is None:
        raise ConfigError(
            "the admin has no Outbox to replay through: call celery_outbox.contrib.django.use(outbox) where the "
            f"Outbox is built, or set {SETTING} = 'proj.celery:outbox' in the Django settings"
        )
    outbox = load(spec)
    with reg.lock:
        if reg.outbox is None:  # loaded once; a use() that raced ahead wins
            reg.outbox = outbox
        return reg.outbox, reg.send


def clock() -> Clock:
    """The configured Outbox's clock (ages, replay times); the system clock when none is configured yet."""
    reg = registration()
    with reg.lock:
        outbox = reg.outbox
    return outbox.clock if outbox is not None else SystemClock()


def replay(ids: Sequence[dl.DeadLetterId]) -> list[dl.ReplayResult]:
    """``dl.replay`` over the configured Outbox: every id checked first, each replayed at most once."""
    outbox, send = configured()
    if send is None and any(i.source == "consumer" for i in ids):
        from celery_outbox.celery.sender import replay_sender

        send = replay_sender(outbox.app, outbox)
    with outbox.sessions()() as session:
        return dl.replay(session, list(ids), tables=outbox.tables, clock=outbox.clock, send=send,
                         known_consumers=outbox.known_consumers())


def purge(ids: Sequence[dl.DeadLetterId]) -> int:
    """``dl.purge`` over the configured Outbox: all or nothing; a row that is not dead-lettered is refused."""
    outbox, _send = configured()
    with outbox.sessions()() as session:
        return dl.purge(session, list(ids), tables=outbox.tables)
