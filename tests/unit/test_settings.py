"""Bad configuration is a clear error naming the variable; good configuration round-trips.

Every setting has one rule (``Settings.RULES``): Hypothesis throws random text and numbers at every
``OUTBOX_*`` variable and random values at every field, and the answer is always either a valid
``Settings`` (checked against an oracle written here, not the rule table) or one ``ConfigError``
whose message is one line naming the variable, never another exception and never a secret.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from celery_outbox import Settings as LibrarySettings
from celery_outbox import exit_on_config_error
from celery_outbox.config.masking import mask_url
from celery_outbox.config.rules import FloatRule, IntRule
from celery_outbox.errors import ConfigError
from celery_outbox.names import check_name
from celeryconfig import DEFAULT_ROUTES, Settings, celery_config
from consumers.search import search

FUZZ = hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(Settings)]
NUMERIC = [n for n in FIELDS if isinstance(Settings.RULES[n], (IntRule, FloatRule))]
ZERO_MEANS_OFF = {"metrics_port", "relay_reconcile_plain_tasks_after_ms", "worker_heartbeat_ms",
                  "db_pre_ping_idle_ms", "relay_gather_ms"}  # documented: 0 = off
SECRETS = ("database_url", "broker_url", "admin_token", "relay_listen_url")


def key(name: str) -> str:
    return f"OUTBOX_{name.upper()}"


def make(cls: type[LibrarySettings] = Settings, **values: Any) -> Any:
    """Build settings from values of any type (hostile input is the point: no static typing here)."""
    return cls(**values)


def test_defaults_are_the_embedded_ones() -> None:
    s = Settings.from_env({})
    assert s.broker_url == "embedded"
    assert s.effective_database_url.startswith("sqlite:///")
    assert dict(s.routes) == DEFAULT_ROUTES


def test_values_are_parsed_from_the_environment() -> None:
    s = Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": "500", "OUTBOX_RELAY_POLL_INTERVAL_S": "0.2",
                           "OUTBOX_HOME": "/tmp/x", "OUTBOX_ROUTES": "A=x,y; B=z",
                           "OUTBOX_BROKER_URL": "amqp://guest:guest@localhost//"})
    assert s.relay_batch_size == 500 and s.relay_poll_interval_s == 0.2 and s.home == Path("/tmp/x")
    assert dict(s.routes) == {"A": ("x", "y"), "B": ("z",)}
    assert s.consumers == ("x", "y", "z")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"OUTBOX_RELAY_BATCH_SIZE": "many"}, "OUTBOX_RELAY_BATCH_SIZE must be int"),
        ({"OUTBOX_RELAY_BATCH_SIZE": "0"}, "must be > 0"),
        ({"OUTBOX_RELAY_POLL_INTERVAL_S": "-1"}, "POLL_INTERVAL"),
        ({"OUTBOX_DATABASE_URL": "mysql://x"}, "sqlite:// or postgresql://"),
        ({"OUTBOX_BROKER_URL": "kafka://x"}, "OUTBOX_BROKER_URL"),
        ({"OUTBOX_ROUTES": "OrderPlaced"}, "OUTBOX_ROUTES"),
        ({"OUTBOX_RELAY_CONFIRM_MODE": "maybe"}, "CONFIRM_MODE"),
        ({"OUTBOX_NAMESPACE": "a b"}, "NAMESPACE"),
    ],
)
def test_bad_config_is_a_clear_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"relay_batch_size": 0}, "OUTBOX_RELAY_BATCH_SIZE must be > 0"),
        ({"relay_poll_interval_s": -1.0}, "POLL_INTERVAL"),
        ({"database_url": "mysql://x"}, "sqlite:// or postgresql://"),
        ({"broker_url": "kafka://x"}, "OUTBOX_BROKER_URL"),
        ({"relay_confirm_mode": "maybe"}, "CONFIRM_MODE"),
        ({"namespace": "a b"}, "NAMESPACE"),
        ({"table_prefix": "Bad-Prefix"}, "table prefix"),
        ({"worker_concurrency": 0}, "OUTBOX_WORKER_CONCURRENCY must be > 0"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_settings_changed_by_replace_are_validated_again() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_BATCH_SIZE must be > 0"):
        Settings().replace(relay_batch_size=0)


def test_the_embedded_broker_is_the_deployment_s_alias_not_the_library_s() -> None:
    assert Settings(broker_url="embedded").broker_url == "embedded"
    with pytest.raises(ConfigError, match="OUTBOX_BROKER_URL"):
        LibrarySettings(broker_url="embedded")
    lib = LibrarySettings.from_env({})
    assert dict(lib.routes) == {} and lib.broker_url == ""
    with pytest.raises(ConfigError, match="no database"):
        _ = lib.effective_database_url


def test_celery_speaks_json_only() -> None:
    conf = celery_config(Settings(), "redis://127.0.0.1:6379/0")
    assert conf["accept_content"] == ["json"]
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["task_acks_late"] is True
    # the deployment's prefetch holds a full batch of its batch search consumer at -c 2
    assert conf["worker_prefetch_multiplier"] * 2 >= search.batch_size


def test_redis_redelivery_follows_the_visibility_timeout() -> None:
    # (a retry may wait at most backoff_max, and a delivery run at most the time limit, both below the
    # visibility timeout: validated at construction)
    settings = Settings(broker_visibility_timeout_s=30, consumer_retry_backoff_max_s=20, consumer_time_limit_s=20)
    conf = celery_config(settings, "redis://127.0.0.1:6379/0")
    opts = conf["broker_transport_options"]
    assert opts["visibility_timeout"] == 30
    # a worker killed while holding kombu's restore mutex must not block restores past the timeout
    assert opts["unacked_mutex_expire"] <= 30 and opts["unacked_restore_interval"] < 30


def test_retry_backoff_must_stay_below_the_visibility_timeout() -> None:
    with pytest.raises(ConfigError, match="must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"):
        Settings.from_env({"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S": "60", "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "60"})
    with pytest.raises(ConfigError, match="must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"):
        Settings(broker_visibility_timeout_s=60, consumer_retry_backoff_max_s=60)


def test_to_env_round_trips_every_field() -> None:
    s = Settings(home=Path("/tmp/h"), database_url="sqlite:////tmp/x.db", broker_url="redis://h:1/0",
                 routes={"A": ("x", "y"), "B": ("z",)}, relay_batch_size=7, relay_poll_interval_s=0.25,
                 admin_token="t" * 16, crash_points="after_mark@2")
    assert Settings.from_env(s.to_env()) == s


# -- one rule per field -----------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [LibrarySettings, Settings])
def test_every_field_has_exactly_one_rule(cls: type[LibrarySettings]) -> None:
    assert {f.name for f in dataclasses.fields(cls)} == set(cls.RULES)
    assert {name for name, rule in cls.RULES.items() if rule.secret} == set(SECRETS)


def test_a_subclass_with_a_field_and_no_rule_fails_loudly() -> None:
    # Given a deployment's subclass that adds a field but forgets its rule
    @dataclass(frozen=True, kw_only=True)
    class Careless(LibrarySettings):
        retries: int = 3

    # When it is built, Then it is a programming error naming the field (not a silent pass)
    with pytest.raises(TypeError, match="no rule in RULES for retries"):
        Careless()


def test_the_defaults_are_valid_and_every_numeric_default_is_in_range() -> None:
    s = Settings()
    for name in NUMERIC:
        rule = Settings.RULES[name]
        assert isinstance(rule, (IntRule, FloatRule))
        assert rule.low <= getattr(s, name) <= rule.high, name


# -- numbers: finite, positive, in range -------------------------------------------------------------

@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1", "-0.5", "", " ", "1.5.2",
                                 "0x10", "\u0661\u0662", "\u00b2", "1e", "--1", "9" * 5000])
def test_no_number_setting_takes_nan_inf_negative_or_garbage(name: str, raw: str) -> None:
    # Given one OUTBOX_* number variable set to a non-finite, negative or malformed value
    # When the settings are read, Then it is one ConfigError naming that variable
    with pytest.raises(ConfigError, match=re.escape(key(name))) as e:
        Settings.from_env({key(name): raw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", NUMERIC)
def test_zero_is_refused_unless_it_documentedly_means_off(name: str) -> None:
    # Given a number setting set to 0 (directly and through its variable)
    if name in ZERO_MEANS_OFF:
        # Then it is accepted only where 0 documentedly means "off", and the rule says so
        assert getattr(make(Settings, **{name: 0}), name) == 0
        assert "0 = off" in getattr(Settings.RULES[name], "zero", "")
        return
    with pytest.raises(ConfigError, match=re.escape(key(name))):
        make(Settings, **{name: 0})
    with pytest.raises(ConfigError, match=re.escape(key(name))):
        Settings.from_env({key(name): "0"})


@pytest.mark.parametrize("name", NUMERIC)
def test_each_number_has_an_upper_bound_that_is_enforced(name: str) -> None:
    rule = Settings.RULES[name]
    assert isinstance(rule, (IntRule, FloatRule))
    # Given the largest value the rule allows and the next one past it
    # Then the next one is refused naming the variable (an int past 2^31 / 2^63 too)
    too_big: list[float] = [rule.high + 1, 2**31, 2**63, 2**64] if isinstance(rule, IntRule) else [rule.high * 2, 1e308]
    for value in too_big:
        if value > rule.high:
            with pytest.raises(ConfigError, match=re.escape(key(name))):
                make(Settings, **{name: int(value) if isinstance(rule, IntRule) else value})


def test_ints_that_reach_the_database_or_celery_fit_32_or_64_bits() -> None:
    for name in NUMERIC:
        rule = Settings.RULES[name]
        assert isinstance(rule, (IntRule, FloatRule))
        assert rule.high < 2**63, name
        if name.endswith(("_count", "_attempts", "_deliveries", "_port", "_size")) or name.startswith("db_"):
            assert rule.high < 2**31, name  # int32 columns, Postgres GUCs, socket options


@pytest.mark.parametrize("value", [True, False, "5", None, [5], 5.5])
def test_a_number_field_needs_a_number_of_its_type(value: object) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_BATCH_SIZE must be int"):
        Settings(relay_batch_size=value)  # type: ignore[arg-type]


def test_ints_are_ascii_digits_only() -> None:
    # int() would read Arabic-Indic or superscript digits as some other number
    for raw in ("\u0661\u0660", "\u0663", "\u00b2", "\u2460", "\uff11\uff10"):  # 10, 3, 2, 1, 10
        with pytest.raises(ConfigError, match="OUTBOX_RELAY_BATCH_SIZE must be int"):
            Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": raw})
    assert Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": " 10 "}).relay_batch_size == 10


def test_the_inbox_prune_guard_cannot_be_switched_off() -> None:
    # Given a redelivery window of zero, negative, or shorter than the reconciler's re-send
    for window in (0, -1, -86_400_000):
        with pytest.raises(ConfigError, match="OUTBOX_BROKER_REDELIVERY_WINDOW_MS must be > 0"):
            Settings(broker_redelivery_window_ms=window)
    with pytest.raises(ConfigError, match=r"OUTBOX_BROKER_REDELIVERY_WINDOW_MS .* must exceed OUTBOX_RELAY_RECONCILE"):
        Settings(broker_redelivery_window_ms=600_000, relay_reconcile_after_ms=600_000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"broker_visibility_timeout_s": 60, "consumer_retry_backoff_max_s": 60, "consumer_time_limit_s": 30},
         "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S .* must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"),
        ({"broker_visibility_timeout_s": 100, "consumer_time_limit_s": 100},
         "OUTBOX_CONSUMER_TIME_LIMIT_S .* must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"),
        ({"relay_reconcile_after_ms": 30_000, "broker_url": "redis://127.0.0.1:6379/0"},
         "OUTBOX_RELAY_RECONCILE_AFTER_MS .* must exceed OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"),
        ({"relay_base_delay_ms": 5_000, "relay_max_delay_ms": 4_999},
         "OUTBOX_RELAY_BASE_DELAY_MS .* must not exceed OUTBOX_RELAY_MAX_DELAY_MS"),
        ({"relay_breaker_base_ms": 5_000, "relay_breaker_max_ms": 4_999},
         "OUTBOX_RELAY_BREAKER_BASE_MS .* must not exceed OUTBOX_RELAY_BREAKER_MAX_MS"),
    ],
)
def test_cross_field_rules(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_every_bad_variable_is_named_in_one_line() -> None:
    # Given three bad variables at once
    env = {"OUTBOX_RELAY_BATCH_SIZE": "x", "OUTBOX_METRICS_PORT": "nope", "OUTBOX_RELAY_POLL_INTERVAL_S": "nan"}
    with pytest.raises(ConfigError) as e:
        Settings.from_env(env)
    # Then one line names each of them
    message = str(e.value)
    assert "\n" not in message and all(k in message for k in env)
    # And so does construction for values that parse but are out of range
    with pytest.raises(ConfigError) as e:
        Settings(metrics_port=70_000, relay_max_attempts=0, namespace="")
    assert all(k in str(e.value) for k in ("OUTBOX_METRICS_PORT", "OUTBOX_RELAY_MAX_ATTEMPTS", "OUTBOX_NAMESPACE"))


@pytest.mark.parametrize("port", [0, 65_535])
def test_metrics_port_is_a_port(port: int) -> None:
    assert Settings(metrics_port=port).metrics_port == port
    with pytest.raises(ConfigError, match="OUTBOX_METRICS_PORT"):
        Settings(metrics_port=-1 if port == 0 else 65_536)


# -- text: namespace, prefix, confirm mode, URLs, routes -----------------------------------------

@pytest.mark.parametrize("namespace", ["", "a b", "a/b", "a#b", "a*b", "-a", "a\n", "a\x00", "ä", "x" * 65, ".a"])
def test_bad_namespaces(namespace: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_NAMESPACE"):
        Settings(namespace=namespace)


@pytest.mark.parametrize("url", [
    "postgresql://u:p@h:70000/db", "postgresql://u:p@h:abc/db", "sqlite:///a\x00b", "postgresql ://h/db",
    "redis://h/0", "postgresql://h/db\n", " sqlite://", "postgresql://h/db extra",
])
def test_bad_database_urls(url: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_DATABASE_URL"):
        Settings(database_url=url)


def test_an_empty_url_is_the_documented_default() -> None:
    assert Settings(database_url="").effective_database_url.startswith("sqlite:///")
    assert LibrarySettings(broker_url="").broker_url == ""


@pytest.mark.parametrize("url", ["redis://h:99999/0", "redis://h:0/0", "amqp://g:g@h:x//", "redis://h/0 ",
                                 "redis://[::1/0", "kafka://h", "redis://h/0;kafka://h", "embedded\x00"])
def test_bad_broker_urls(url: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_BROKER_URL"):
        Settings(broker_url=url)


def test_failover_broker_urls_are_each_checked() -> None:
    assert Settings(broker_url="amqp://a//;amqp://b//").broker_url == "amqp://a//;amqp://b//"


@given(name=st.text(max_size=80))
@FUZZ
@example(name="shipping")
@example(name="a" * 64)
@example(name="a" * 65)
@example(name="shipping\n")
@example(name="ship ping")
@example(name="-x")
@example(name="\u0663")
def test_consumer_names_in_routes_are_checked_exactly_like_consumer_names(name: str) -> None:
    # Given a route to a consumer of any name
    try:
        check_name(name)
        valid = True
    except ConfigError:
        valid = False
    # Then the settings accept it exactly when @consumer(name=...) would
    if valid:
        assert Settings(routes={"E": (name,)}).consumers == (name,)
    else:
        with pytest.raises(ConfigError, match="OUTBOX_ROUTES"):
            Settings(routes={"E": (name,)})


@pytest.mark.parametrize("event", ["", " ", " A", "A ", "A\x00", "A\ud800", "A\n", "x" * 201, "A=B", "A;B", "A,B"])
def test_bad_event_types_in_routes(event: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_ROUTES"):
        Settings(routes={event: ("shipping",)})


@pytest.mark.parametrize("routes", [{"A": ()}, {"A": "shipping"}, {"A": None}, ["A"], {"A": ("ok", 5)}])
def test_malformed_routes(routes: object) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_ROUTES"):
        Settings(routes=routes)  # type: ignore[arg-type]


def test_event_types_may_be_printable_and_long() -> None:
    event = "orders.placed/v1 ü" + "x" * 182
    assert len(event) == 200
    assert Settings(routes={event: ("shipping",)}).routes == {event: ("shipping",)}


@pytest.mark.parametrize(("name", "value"), [
    ("admin_token", "a\x00b"), ("admin_token", " padded"), ("crash_points", "nowhere"), ("home", ""),
    ("home", Path("a\x00b")), ("relay_confirm_mode", "CONFIRM"), ("table_prefix", "x" * 40),
])
def test_other_text_settings(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key(name)):
        make(Settings, **{name: value})


# -- Hypothesis: every variable, every field ----------------------------------------------------------

def number_text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.floats(allow_nan=True, allow_infinity=True).map(str),
        st.sampled_from(["nan", "inf", "-inf", "1e309", "0", "-0", "0.0", "1_000", " 7 ", "0x1f", "1e3", "+5", "\u0663"]),
    )


def raw_text() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=60), st.text(alphabet=string.printable, max_size=60), number_text())


def check_outcome(build: Any, secrets: tuple[str, ...] = ()) -> LibrarySettings | None:
    """``build()`` gives a valid Settings or a one-line ConfigError; anything else fails the test."""
    try:
        s: LibrarySettings = build()
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message and "\r" not in message
        for secret in secrets:
            assert secret not in message
        return None
    oracle(s)
    return s


def oracle(s: LibrarySettings) -> None:
    """What a valid Settings must be, stated independently of the rule table."""
    for name in (n for n in NUMERIC if hasattr(s, n)):
        value = getattr(s, name)
        assert not isinstance(value, bool) and isinstance(value, (int, float)), name
        assert math.isfinite(value) and (value >= 0 if name in ZERO_MEANS_OFF else value > 0), (name, value)
        assert value < 2**63, name
    assert 0 <= s.metrics_port <= 65_535
    assert s.admin_token == "" or len(s.admin_token) >= 16
    assert s.broker_redelivery_window_ms > s.relay_reconcile_after_ms
    assert s.broker_redelivery_window_ms > s.relay_reconcile_plain_tasks_after_ms
    if s.kind_of_broker(s.broker_url) == "redis":  # the visibility timeout is Redis's alone
        assert s.relay_reconcile_after_ms > s.broker_visibility_timeout_s * 1000
        assert s.consumer_retry_backoff_max_s < s.broker_visibility_timeout_s
        assert s.consumer_time_limit_s < s.broker_visibility_timeout_s
    assert s.relay_confirm_mode in ("confirm", "tx", "none")
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", s.namespace, re.ASCII)
    for event, names in s.routes.items():
        assert event.strip() and event.isprintable() and len(event) <= 200
        assert names and all(check_name(n) for n in names)
    # secrets: the token is never shown, each URL is shown as mask_url shows it
    shown = repr(s)
    assert str(s) == shown
    assert f"admin_token={('***' if s.admin_token else '')!r}" in shown
    for name in ("database_url", "broker_url"):
        assert f"{name}={mask_url(getattr(s, name))!r}" in shown


def same_env(s: LibrarySettings) -> None:
    """A valid result is what a child process rebuilds from ``to_env`` (home resolved, floats as text)."""
    again = type(s).from_env(s.to_env())
    assert again.to_env() == s.to_env()


@given(name=st.sampled_from(FIELDS), raw=raw_text())
@FUZZ
def test_any_text_in_any_variable_is_settings_or_one_config_error(name: str, raw: str) -> None:
    # Given any text in any one OUTBOX_* variable, When the settings are read
    s = check_outcome(lambda: Settings.from_env({key(name): raw}))
    # Then a valid result round-trips through the environment a child process would get
    if s is not None:
        same_env(s)


@given(env=st.dictionaries(st.sampled_from(FIELDS).map(key), raw_text(), max_size=8))
@FUZZ
def test_any_mix_of_variables_is_settings_or_one_config_error(env: dict[str, str]) -> None:
    s = check_outcome(lambda: Settings.from_env(env))
    if s is not None:
        same_env(s)


@given(name=st.sampled_from(NUMERIC), raw=number_text())
@FUZZ
def test_any_number_in_any_number_variable(name: str, raw: str) -> None:
    s = check_outcome(lambda: Settings.from_env({key(name): raw}))
    if s is not None:
        assert getattr(s, name) == float(raw.strip())


@given(name=st.sampled_from(FIELDS),
       value=st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                       st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                                                                  max_size=2)))
@FUZZ
def test_any_value_in_any_field_is_settings_or_one_config_error(name: str, value: object) -> None:
    library_values = {name: value} if name in LibrarySettings.RULES else {}
    for s in (check_outcome(lambda: make(Settings, **{name: value})),
              check_outcome(lambda: make(LibrarySettings, **library_values))):
        if s is not None:
            same_env(s)


MARK = "S3cr3tMark"


@given(field=st.sampled_from(SECRETS), before=st.text(max_size=20), after=st.text(max_size=20))
@FUZZ
def test_a_secret_variable_s_value_is_never_repeated_unless_it_is_a_url(field: str, before: str, after: str) -> None:
    # Given a secret variable holding text that is not a URL (a password pasted in the wrong place)
    raw = before + MARK + after
    if field != "admin_token" and "://" in raw:
        raw = raw.replace("://", "")
    # When the settings are read, Then neither the error nor the repr shows it
    s = check_outcome(lambda: Settings.from_env({key(field): raw}), secrets=(MARK,))
    if s is not None:
        assert MARK not in repr(s)


@given(password=st.text(alphabet=string.ascii_letters + string.digits, min_size=0, max_size=12).map(lambda p: MARK + p),
       rest=st.sampled_from(["h:70000/db", "h/db\n", "h:x/db", "h/db", "[::1/db"]),
       scheme=st.sampled_from(["postgresql", "mysql", "redis", "amqp", "kafka"]),
       field=st.sampled_from(["database_url", "broker_url"]))
@FUZZ
def test_a_password_in_a_bad_url_never_appears_in_the_error(password: str, rest: str, scheme: str, field: str) -> None:
    url = f"{scheme}://user:{password}@{rest}"
    check_outcome(lambda: Settings.from_env({key(field): url}), secrets=(password,))
    check_outcome(lambda: make(Settings, **{field: url}), secrets=(password,))


# -- secrets ----------------------------------------------------------------------------------------

DB_PW, BROKER_PW, TOKEN = "dbSecret-1234", "brokerSecret-5678", "adminTokenSecret-9"


@pytest.mark.parametrize("cls", [LibrarySettings, Settings])
def test_repr_and_str_mask_passwords_and_the_token(cls: type[LibrarySettings]) -> None:
    s = cls(database_url=f"postgresql://app:{DB_PW}@db.example:5432/app?sslpassword={DB_PW}",
            broker_url=f"amqp://app:{BROKER_PW}@rabbit:5672//", admin_token=TOKEN)
    for text in (repr(s), str(s), f"{s}", f"{s!r}", repr([s]), repr({"s": s})):
        assert DB_PW not in text and BROKER_PW not in text and TOKEN not in text
        assert "postgresql://app:***@db.example:5432/app" in text and "amqp://app:***@rabbit:5672//" in text
    # And the values themselves are untouched (a child process gets them through to_env)
    assert s.to_env()["OUTBOX_ADMIN_TOKEN"] == TOKEN and BROKER_PW in s.broker_url


def test_any_new_subclass_masks_too() -> None:
    # Given a user's own subclass (its @dataclass would generate a repr showing every value)
    @dataclass(frozen=True, kw_only=True)
    class Mine(Settings):
        RULES = {**Settings.RULES, "extra": IntRule(1, 10)}
        broker_url: str = "redis://127.0.0.1:6379/0"  # a field redefined here
        extra: int = 1

    s = Mine(broker_url=f"redis://:{BROKER_PW}@h:6379/0", admin_token=TOKEN)
    # Then its repr masks the same secrets
    assert BROKER_PW not in repr(s) and TOKEN not in repr(s) and "extra=1" in repr(s)


@given(password=st.text(alphabet=string.ascii_letters + string.digits + "!$%&()*+,;=-._~", min_size=6, max_size=30),
       user=st.sampled_from(["", "app", "guest"]), scheme=st.sampled_from(["postgresql", "redis", "amqp", "x"]),
       tail=st.sampled_from(["db.example:5432/app", "[::1]:6379/0", "rabbit//", "h/db?sslmode=require"]))
@FUZZ
def test_mask_url_never_shows_the_password(password: str, user: str, scheme: str, tail: str) -> None:
    # Given a URL whose password holds any URL-safe characters, When it is masked
    masked = mask_url(f"{scheme}://{user}:{password}@{tail}")
    # Then exactly the password is replaced
    assert masked == f"{scheme}://{user}:***@{tail}"


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user@h/0", "redis://user@h/0"),
    ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u:p/ss@h/db", "postgresql://u:***@h/db"),
    ("postgresql://h/db?password=pw&x=1", "postgresql://h/db?password=***&x=1"),
    ("amqp://a:pa@h//;amqp://b:pb@h2//", "amqp://a:***@h//;amqp://b:***@h2//"),
    ("user:pw@host", "***@host"),
    ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
])
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_celery_config_holds_no_settings_object_and_masks_in_its_own_report() -> None:
    from celery import Celery

    s = Settings(database_url=f"postgresql://app:{DB_PW}@db/app", admin_token=TOKEN)
    broker = f"redis://:{BROKER_PW}@127.0.0.1:6379/0"
    conf = celery_config(s, broker)
    # Given the Celery configuration of the deployment, Then no value is the Settings object,
    # and only broker_url (which Celery masks itself) holds a secret
    holders = [k for k, v in conf.items() if any(x in repr(v) for x in (DB_PW, BROKER_PW, TOKEN))]
    assert holders == ["broker_url"]
    assert not any(isinstance(v, LibrarySettings) for v in conf.values())
    app = Celery("t", set_as_current=False)
    app.conf.update(conf)
    for text in (app.conf.humanize(with_defaults=True), repr(app.conf.table(with_defaults=True))):
        assert DB_PW not in text and BROKER_PW not in text and TOKEN not in text


def test_the_deployment_s_app_conf_shows_no_secret_in_what_celery_reports(tmp_path: Path) -> None:
    from celery.app.utils import bugreport

    from relay.factory import create_outbox

    # Given the deployment's Outbox built from settings that carry every secret (nothing connects yet)
    s = Settings(home=tmp_path, database_url=f"postgresql://app:{DB_PW}@127.0.0.1:1/app", admin_token=TOKEN,
                 broker_url=f"redis://:{BROKER_PW}@127.0.0.1:1/0")
    app = create_outbox(s).app
    # When Celery renders its configuration as `inspect conf` and `celery report` do
    # (table() is censored by default; bugreport is what `report` prints)
    texts = [repr(app.conf.table(with_defaults=w)) for w in (False, True)] + [bugreport(app)]
    # Then no password and no token is in it
    for text in texts:
        assert DB_PW not in text and BROKER_PW not in text and TOKEN not in text
    assert "redis://:********@127.0.0.1:1/0" in texts[0]


# -- the entry-point helper -------------------------------------------------------------------------

def test_exit_on_config_error_is_one_line_and_a_status(capsys: pytest.CaptureFixture[str]) -> None:
    # Given a ConfigError raised inside the helper
    with pytest.raises(SystemExit) as e, exit_on_config_error(code=4):
        Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": "x", "OUTBOX_METRICS_PORT": "y"})
    # Then it exits with that status and one line on stderr, no traceback
    assert e.value.code == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bad configuration: OUTBOX_RELAY_BATCH_SIZE must be int")
    assert "OUTBOX_METRICS_PORT" in err and "Traceback" not in err


def test_exit_on_config_error_masks_a_url_password_in_any_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    # Given a ConfigError raised elsewhere that quotes a URL with its password, over two lines
    with pytest.raises(SystemExit), exit_on_config_error():
        raise ConfigError(f"database URL 'postgresql://app:{DB_PW}@db/' names no database\nsee the docs")
    # Then the one line masks the password
    err = capsys.readouterr().err
    assert err == "bad configuration: database URL 'postgresql://app:***@db/' names no database see the docs\n"


def test_exit_on_config_error_lets_other_errors_through() -> None:
    with pytest.raises(ValueError, match="other"), exit_on_config_error():
        raise ValueError("other")


def test_settings_module_reads_no_environment_on_import() -> None:
    code = "import os; os.environ['OUTBOX_RELAY_BATCH_SIZE'] = 'x'; import celeryconfig, celery_outbox.settings; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_first_batch_may_not_exceed_the_in_flight_bound() -> None:
    # Given a starting batch larger than the rows allowed in flight (the bound on duplicates after a crash)
    # Then the settings are refused naming both variables
    with pytest.raises(ConfigError, match=r"OUTBOX_RELAY_BATCH_SIZE .*OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS"):
        Settings(relay_batch_size=2_000, relay_max_in_flight_rows=1_000)
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS"):
        Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": "50", "OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS": "49"})
    s = Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": "50", "OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS": "50"})
    assert (s.relay_batch_size, s.relay_max_in_flight_rows) == (50, 50)


# -- configurations that would start and then refuse every order, or arm the wrong crash ----------------

@pytest.mark.parametrize(("raw", "match"), [
    ("A=x,x", "routes 'A' to 'x' twice"),
    ("A=x,y,x;B=z", "routes 'A' to 'x' twice"),
    ("A=x;A=y", "routes 'A' twice"),
    ("A=x,x;A=y", "OUTBOX_ROUTES"),
    (" A =x; A=y", "routes 'A' twice"),
])
def test_a_route_given_twice_or_a_consumer_named_twice_is_refused_at_parse(raw: str, match: str) -> None:
    # Given routes that name an event type twice or one consumer twice in a route
    with pytest.raises(ConfigError, match=match) as caught:
        Settings.from_env({"OUTBOX_ROUTES": raw})
    # Then one line naming the variable, not a merge or an overwrite found out at the first order
    assert "OUTBOX_ROUTES" in str(caught.value) and "\n" not in str(caught.value)


def test_a_consumer_named_twice_in_code_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_ROUTES routes 'A' to 'x' twice"):
        Settings(routes={"A": ("x", "y", "x")})
    assert Settings(routes={"A": ("x", "y"), "B": ("x",)}).consumers == ("x", "y")  # one consumer, two routes: fine


@pytest.mark.parametrize("spec", [
    "after_mark@abc", "after_mark@", "after_mark@0", "after_mark@-1", "after_mark@+2", "after_mark@1.5",
    "after_mark@\u0661", "after_mark@\uff12", "after_mark@\u00b2", "after_mark@2@3", "after_mark@1000000000",
    "@2", "nowhere", "nowhere@2", "after_mark,after_mark@2", "after_mark @ x",
])
def test_a_malformed_or_unknown_crash_point_is_refused(spec: str) -> None:
    # Given a crash point spec that is not NAME or NAME@N (N in ASCII digits), or names no known point
    with pytest.raises(ConfigError, match="OUTBOX_CRASH_POINTS is not valid") as caught:
        Settings.from_env({"OUTBOX_CRASH_POINTS": spec})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("spec", "armed"), [
    ("", frozenset()), ("after_mark", {"after_mark"}), ("after_mark@2", {"after_mark"}),
    (" after_mark@2 , consumer_before_commit ", {"after_mark", "consumer_before_commit"}),
    ("after_mark@999999999", {"after_mark"}),
])
def test_well_formed_crash_points_are_armed(spec: str, armed: set[str]) -> None:
    from celery_outbox.crashpoints import CrashPoints

    assert Settings.from_env({"OUTBOX_CRASH_POINTS": spec}).crash_points == spec
    assert CrashPoints(spec=spec).armed == armed


def test_a_crash_point_fires_on_the_nth_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_outbox import crashpoints

    killed: list[int] = []
    fake_os = SimpleNamespace(kill=lambda pid, sig: killed.append(sig), getpid=lambda: 0, environ={})
    monkeypatch.setattr(crashpoints, "os", fake_os)
    points = crashpoints.CrashPoints(spec="after_mark@3")
    for _ in range(2):
        points.reached("after_mark")
    assert killed == []
    points.reached("after_mark")
    assert len(killed) == 1


@pytest.mark.parametrize("token", ["x", "short-token", "fifteen-chars-x"])
def test_a_short_admin_token_is_refused_without_showing_it(token: str) -> None:
    # Given an admin token shorter than the minimum (empty means the page is off, and stays allowed)
    with pytest.raises(ConfigError, match="OUTBOX_ADMIN_TOKEN must be at least 16 characters") as caught:
        Settings.from_env({"OUTBOX_ADMIN_TOKEN": token})
    # Then the value is never repeated
    assert f"'{token}'" not in str(caught.value) and "not shown" in str(caught.value)
    assert Settings(admin_token="").admin_token == ""
    assert Settings(admin_token="sixteen-chars-ok").admin_token == "sixteen-chars-ok"
