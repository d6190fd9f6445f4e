"""Django system checks: ``manage.py check`` (and every ``runserver``, ``migrate``, ``manage.py outbox``) reports
what would otherwise surface as a 500, a worker that refuses to start or a task nobody runs.

=======================  ===========================================================================================
``celery_outbox.E001``   the outbox settings are invalid (``OUTBOX = {...}``, ``OUTBOX_*``, the environment, or a
                         value the Celery app's broker rules out); ``DjangoOutbox`` is built anyway and raises
                         this message at its first use
``celery_outbox.E002``   an ``OUTBOX_*`` name in settings.py that no outbox setting has (a typo, otherwise ignored)
``celery_outbox.E003``   ``OUTBOX_INSTANCE`` does not name an ``Outbox``
``celery_outbox.E004``   a route names a consumer this project neither declares nor routes to another service
``celery_outbox.W001``   a task or consumer is routed to a queue the Celery app's ``task_queues`` does not list: a
                         worker started without ``-Q`` never consumes it (silence it with
                         ``SILENCED_SYSTEM_CHECKS`` when a worker is started with ``-Q <queue>``)
=======================  ===========================================================================================

The route and queue checks need the project's ``Outbox``: the one ``DjangoOutbox(app)`` registered (built
when ``proj/__init__.py`` imports ``proj/celery.py``), else ``OUTBOX_INSTANCE``. Without either they are skipped.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django.core import checks

from celery_outbox.errors import ConfigError

if TYPE_CHECKING:
    from celery_outbox.outbox import Outbox

TAG = "celery_outbox"


def settings_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E001 (the settings do not load) and E002 (unknown ``OUTBOX_*`` names)."""
    from django.conf import settings

    from celery_outbox.contrib.django.conf import known_setting_names, outbox_settings, unknown_setting_names

    errors: list[checks.CheckMessage] = []
    known = [f"OUTBOX_{name.upper()}" for name in known_setting_names()]
    for name in unknown_setting_names(settings):
        close = difflib.get_close_matches(name, known, n=1)
        errors.append(checks.Error(
            f"settings.{name} is not an outbox setting, so it has no effect",
            hint=f"did you mean {close[0]}?" if close else "see docs/settings.md for the names",
            obj=f"settings.{name}", id="celery_outbox.E002"))
    from celery_outbox.contrib.django import dead_letters

    refused: ConfigError | None = None
    try:
        outbox_settings()
    except ConfigError as e:
        refused = e
    registered = dead_letters.registered()
    if refused is None and registered is not None:
        refused = registered.settings_error  # e.g. a setting the Celery app's broker rules out
    if refused is not None:
        errors.append(checks.Error(f"the outbox settings are invalid: {_one_line(str(refused))}",
                                   hint="fix the OUTBOX / OUTBOX_* value in settings.py or the environment; until "
                                        "then the outbox refuses every use with this message",
                                   obj="settings.OUTBOX", id="celery_outbox.E001"))
    return errors


def outbox_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E003 (``OUTBOX_INSTANCE``), E004 (a route to an unknown consumer), W001 (a queue no worker consumes)."""
    from celery_outbox.contrib.django import dead_letters

    outbox = dead_letters.registered()
    if outbox is None:
        from django.conf import settings

        spec = getattr(settings, dead_letters.SETTING, None)
        if spec is None:
            return []
        try:
            outbox = dead_letters.load(spec)
        except ConfigError as e:
            return [checks.Error(_one_line(str(e)), hint="OUTBOX_INSTANCE = 'proj.celery:outbox' names the Outbox "
                                 "proj/celery.py builds", obj=f"settings.{dead_letters.SETTING}",
                                 id="celery_outbox.E003")]
    if outbox.settings_error is not None:
        return []  # E001 (settings_check) reports it; routes and queues built on refused settings mean nothing
    errors: list[checks.CheckMessage] = []
    try:
        outbox.check()
    except ConfigError as e:
        errors.append(checks.Error(_one_line(str(e)), obj="OUTBOX_ROUTES", id="celery_outbox.E004",
                                   hint="a worker of this app refuses to start until the route is fixed"))
    errors.extend(unconsumed_queues(outbox))
    return errors


def routed_queues(outbox: Outbox) -> Iterator[tuple[str, str]]:
    """(task name, queue name) for each task of the app that names a queue: its own ``queue`` option, else
    the first matching ``task_routes`` entry. A task routed nowhere goes to the default queue."""
    app = outbox.app
    router = app.amqp.router
    for name, task in sorted(app.tasks.items()):
        if name.startswith("celery."):
            continue
        queue: Any = getattr(task, "queue", None)
        if queue is None:
            try:
                route = router.lookup_route(name, (), {}, {}, task) if router.routes else None
            except Exception:  # a project's routing function failing on empty arguments: nothing knowable
                route = None
            queue = route if isinstance(route, str) else (route or {}).get("queue")
        if queue is not None:
            yield name, str(getattr(queue, "name", queue))


def unconsumed_queues(outbox: Outbox) -> list[checks.CheckMessage]:
    """W001: a queue a task is routed to that a worker started without ``-Q`` does not consume (the app's
    ``task_queues``, else its default queue)."""
    conf = outbox.app.conf
    consumed = {q.name for q in conf.task_queues or ()} or {conf.task_default_queue or "celery"}
    missing: dict[str, list[str]] = {}
    for task, queue in routed_queues(outbox):
        if queue not in consumed:
            missing.setdefault(queue, []).append(task)
    return [checks.Warning(
        f"queue {queue!r} ({', '.join(tasks[:3])}{' ...' if len(tasks) > 3 else ''}) is not in the Celery app's "
        "task_queues: a worker started without -Q never consumes it, so those tasks wait forever",
        hint=f"add it to CELERY_TASK_QUEUES, or start a worker with -Q {queue} and add 'celery_outbox.W001' to "
             "SILENCED_SYSTEM_CHECKS", obj=f"queue {queue}", id="celery_outbox.W001")
        for queue, tasks in sorted(missing.items())]


def _one_line(text: str) -> str:
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return first if len(first) <= 500 else first[:497] + "..."


def register() -> None:
    """Called from the app's ``ready()``."""
    checks.register(settings_check, TAG)
    checks.register(outbox_check, TAG)
