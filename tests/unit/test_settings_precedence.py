"""One precedence rule wherever settings are built: explicit arguments > ``OUTBOX_*`` environment > defaults."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from celery import Celery
from flask import Flask

from celery_outbox import ConfigError, Outbox, Settings, TransactionRequiredError
from celery_outbox.contrib.flask import init_app
from celeryconfig import Settings as DeploymentSettings

TOKEN = "operator-token-0123456789"


def test_explicit_arguments_beat_the_environment_which_beats_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an operator's variables, one of them for a field the code also sets
    monkeypatch.setenv("OUTBOX_NAMESPACE", "from-env")
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "7")
    monkeypatch.setenv("OUTBOX_ADMIN_TOKEN", TOKEN)
    # When the code builds Settings with some explicit arguments
    s = Settings(namespace="from-code", relay_max_attempts=10)
    # Then explicit wins (even when equal to the default), the environment fills the rest, defaults after
    assert s.namespace == "from-code" and s.relay_batch_size == 7 and s.admin_token == TOKEN
    assert s.relay_max_attempts == 10 and s.relay_poll_interval_s == 1.0
    monkeypatch.setenv("OUTBOX_RELAY_MAX_ATTEMPTS", "3")
    assert Settings(relay_max_attempts=10).relay_max_attempts == 10 and Settings().relay_max_attempts == 3
    # And from_env(**overrides) is the same rule, with the same result
    assert Settings.from_env(namespace="from-code", relay_max_attempts=10) == s.replace(relay_max_attempts=10)
    # And a deployment's subclass follows it too
    assert DeploymentSettings(home=Path("h")).namespace == "from-env"


def test_a_given_mapping_replaces_the_environment_and_replace_keeps_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_NAMESPACE", "from-env")
    # from_env with a mapping reads only that mapping (tests: from_env({}) is the pure defaults)
    assert Settings.from_env({}).namespace == "outbox"
    assert Settings.from_env({"OUTBOX_NAMESPACE": "given"}, relay_batch_size=5).namespace == "given"
    # replace() copies every value: the environment changing later does not leak in
    s = Settings.from_env({}, namespace="a")
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "9")
    assert s.replace(relay_max_attempts=4).relay_batch_size == 100


def test_a_bad_variable_is_one_line_naming_it_even_beside_explicit_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "lots")
    with pytest.raises(ConfigError, match=r"^OUTBOX_RELAY_BATCH_SIZE must be int .*got 'lots'$"):
        Settings(namespace="shop")
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "5")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://u:hunter2-secret@db/x y")
    with pytest.raises(ConfigError, match=r"^OUTBOX_DATABASE_URL must be") as raised:
        Settings(namespace="shop")
    assert "\n" not in str(raised.value) and "hunter2" not in str(raised.value)
    # an explicit argument is not read from the environment, so its bad variable is not an error
    assert Settings(relay_batch_size=5, database_url="").relay_batch_size == 5


def test_an_operators_admin_token_and_enqueue_mode_take_effect_on_an_outbox_built_in_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the team's glue builds Settings(namespace=...) in code, and the operator sets two variables
    monkeypatch.setenv("OUTBOX_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION", "raise")
    app = Celery("prec", broker="memory://localhost/", set_as_current=False)
    queue = f"prec-{uuid.uuid4().hex[:8]}"
    app.conf.task_routes = {"prec.t": {"queue": queue}}
    outbox = Outbox(app, settings=Settings(namespace="shop", database_url="sqlite://"))

    @app.task(name="prec.t", shared=False)  # type: ignore[untyped-decorator]
    def t() -> None:
        pass

    # Then the strict enqueue mode is on
    with pytest.raises(TransactionRequiredError):
        t.delay()
    # And the dead-letter page exists, behind the operator's token
    web = Flask("prec")
    init_app(web, outbox, readiness_path=None)
    client = web.test_client()
    assert client.get("/admin/dead-letters/").status_code == 401
    assert client.get("/admin/dead-letters/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code != 404
    outbox.sessions().kw["bind"].dispose()
