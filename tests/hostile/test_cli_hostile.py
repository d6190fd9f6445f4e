"""The ``outbox`` CLI under hostile input and faults: look-alike ids, a database that is not migrated or
not reachable. Every case ends with a clear exit code and ONE line, never a traceback, never another
dead letter than the one named, never the database password."""

from __future__ import annotations

import json
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, ValidationError
from celery_outbox.cli import cli
from celery_outbox.config.masking import mask_secrets
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.delivery import _error_text
from celery_outbox.errors import ConfigError
from celery_outbox.inbox import dead_letters as consumer_dead_letters
from celery_outbox.ops import partitions as ops_partitions
from celery_outbox.ops.dead_letter_groups import check_group_id, list_groups
from celery_outbox.ops.dead_letters import DeadLetterId, parse_ids
from celery_outbox.ops.trace import check_key
from tests.ops_seed import T0, consumer_dead_letter, inbox_rows, outbox_row

PASSWORD = "cli-pw-never-shown"
LOOKALIKES = ["outbox:\u00b2", "consumer:\u2460", "consumer:\u0661", "outbox:\uff11", "consumer:01", "consumer:+1", "consumer:-1",
              "consumer:1.0", "consumer:1_0", "consumer:99999999999999999999", "consumer:1\u2003", "Consumer:1",
              "consumer:", ":1", "consumer:1:1", "consumer:\x00"]
DB_COMMANDS = [
    ["stats"], ["stats", "--json"], ["dead-letters", "list"], ["dead-letters", "show", "outbox:1"],
    ["dead-letters", "replay", "outbox:1"], ["dead-letters", "replay", "--all"],
    ["dead-letters", "purge", "outbox:1", "--yes"], ["prune", "--published-older-than", "1d"],
]


def run(env: dict[str, str], *args: str) -> Result:
    # a fresh relay.app per invocation, as a new process would build it (see test_ops_cli.run)
    sys.modules.pop("relay.app", None)
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def assert_one_clean_line(r: Result, *, exit_code: int = 1) -> str:
    assert r.exit_code == exit_code, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert "Traceback" not in r.output and PASSWORD not in r.output
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def base_env(tmp_home: Path, namespace: str, url: str) -> dict[str, str]:
    return {"OUTBOX_DATABASE_URL": url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
            "OUTBOX_BROKER_URL": "memory://"}


# -- ids ---------------------------------------------------------------------------------------------

@hsettings(max_examples=300, deadline=None)
@given(raw=st.one_of(st.text(max_size=30), st.from_regex(r"\A(outbox|consumer):[0-9\u0661\u00b2\u2460\uff10-\uff19]{0,22}\Z")))
def test_an_id_parses_to_itself_or_not_at_all(raw: str) -> None:
    # Given any text; When it is parsed as a dead-letter id
    try:
        ref = DeadLetterId.parse(raw)
    except ValidationError as e:
        assert "not a dead-letter id" in str(e) and len(str(e)) < 300  # one bounded line
        return
    # Then it names exactly the id written (ASCII digits, no sign, no leading zero), never a look-alike's
    assert str(ref) == raw  # exactly the text given: blanks around an id are refused, not stripped
    assert str(ref.row_id).isascii() and 0 < ref.row_id < 2**63


@pytest.mark.parametrize("raw", LOOKALIKES)
def test_lookalike_ids_are_refused_by_the_parser(raw: str) -> None:
    with pytest.raises(ValidationError, match="not a dead-letter id"):
        parse_ids([raw])


@pytest.fixture
def seeded_env(sqlite_url: str, tmp_home: Path, namespace: str,
               tables: Tables) -> Iterator[tuple[dict[str, str], Any]]:
    """outbox:1 and consumer:1 exist: a look-alike read as 1 would show, replay or purge them."""
    engine = make_engine(sqlite_url)
    sessions: sessionmaker[Session] = make_session_factory(engine)
    with sessions() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10, last_error="outbox-one-error")
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", error="consumer-one-error")
    assert (row.seq, cid) == (1, 1)
    yield base_env(tmp_home, namespace, sqlite_url), sessions
    engine.dispose()


def dead_state(sessions: sessionmaker[Session], tables: Tables) -> tuple[Any, ...]:
    with sessions() as s:
        return (s.execute(sa.select(tables.outbox.seq, tables.outbox.dead_lettered_at_ms)).all(),
                s.execute(sa.select(tables.dead_letters.id, tables.dead_letters.replayed_at_ms)).all())


@pytest.mark.parametrize("raw", LOOKALIKES)
def test_lookalike_ids_are_one_line_errors_and_touch_nothing(seeded_env: tuple[dict[str, str], Any], tables: Tables,
                                                             raw: str) -> None:
    env, sessions = seeded_env
    before = dead_state(sessions, tables)
    # When each command is given a look-alike of id 1
    for args in (["dead-letters", "show", raw], ["dead-letters", "show", raw, "--json"],
                 ["dead-letters", "replay", raw], ["dead-letters", "purge", raw, "--yes"]):
        r = run(env, *args)
        # Then one line saying it is not an id, exit 2 (usage), and dead letter 1 was neither shown nor changed
        line = assert_one_clean_line(r, exit_code=2)
        assert "not a dead-letter id" in line
        assert "one-error" not in r.output
    assert dead_state(sessions, tables) == before


BLANKED = [" outbox:1 ", "outbox:1 ", "\toutbox:1", "consumer:1\n", "\r\nconsumer:1"]


@pytest.mark.parametrize("raw", BLANKED)
def test_an_id_with_blanks_around_it_is_refused_not_stripped(seeded_env: tuple[dict[str, str], Any], tables: Tables,
                                                             raw: str) -> None:
    # Given dead letters outbox:1 and consumer:1
    env, sessions = seeded_env
    before = dead_state(sessions, tables)
    # When a command is given one of their ids with blanks around it
    for args in (["dead-letters", "show", raw], ["dead-letters", "replay", raw], ["dead-letters", "purge", raw, "--yes"]):
        r = run(env, *args)
        # Then one line saying it is not an id (the one rule, docs/operations.md), exit 2, nothing shown or changed
        line = assert_one_clean_line(r, exit_code=2)
        assert "not a dead-letter id" in line and "one-error" not in r.output
    assert dead_state(sessions, tables) == before


def test_a_group_id_with_blanks_around_it_is_refused_not_stripped(seeded_env: tuple[dict[str, str], Any],
                                                                  tables: Tables) -> None:
    env, sessions = seeded_env
    with sessions() as s:
        gid = next(g.id for g in list_groups(s, tables=tables) if g.source == "outbox")
    before = dead_state(sessions, tables)
    for padded in (f" {gid} ", f"{gid}\n"):
        r = run(env, "dead-letters", "replay", "--group", padded)
        line = assert_one_clean_line(r, exit_code=2)
        assert "not a dead-letter group" in line
        r = run(env, "dead-letters", "purge", "--group", padded, "--yes")
        assert "not a dead-letter group" in assert_one_clean_line(r, exit_code=2)
    assert dead_state(sessions, tables) == before


# -- database not migrated / not reachable -----------------------------------------------------------

@pytest.mark.parametrize("args", DB_COMMANDS)
def test_unmigrated_database_says_run_db_upgrade(tmp_path: Path, tmp_home: Path, namespace: str,
                                                 args: list[str]) -> None:
    # Given a database file with no tables at all
    env = base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'empty.db'}")
    # When an on-call command runs; Then one line that says what to do
    line = assert_one_clean_line(run(env, *args))
    assert "run `outbox db upgrade`" in line


def test_db_current_and_check_on_an_unmigrated_database(tmp_path: Path, tmp_home: Path, namespace: str) -> None:
    env = base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'empty.db'}")
    line = assert_one_clean_line(run(env, "db", "current"), exit_code=0)
    assert line.startswith("empty") and "run `outbox db upgrade`" in line
    line = assert_one_clean_line(run(env, "db", "check"))
    assert "run `outbox db upgrade`" in line


@pytest.mark.parametrize("args", [*DB_COMMANDS, ["db", "upgrade"], ["db", "current"], ["db", "check"]])
def test_unreachable_database_is_one_line_without_the_password(tmp_home: Path, namespace: str,
                                                               args: list[str]) -> None:
    # Given a Postgres URL with a password, on a port nobody listens on
    url = f"postgresql://outbox_user:{PASSWORD}@127.0.0.1:{closed_port()}/outbox"
    # When any command that needs the database runs; Then exit 1, one line, no password, no traceback
    line = assert_one_clean_line(run(base_env(tmp_home, namespace, url), *args))
    assert line.startswith("Error: ") and "connection" in line.lower()


def test_a_malformed_url_never_prints_its_password(tmp_home: Path, namespace: str) -> None:
    # Given a URL SQLAlchemy cannot even parse (bad port), carrying a password
    url = f"postgresql://outbox_user:{PASSWORD}@127.0.0.1:notaport/outbox"
    r = run(base_env(tmp_home, namespace, url), "stats")
    # Then a clean error without the password, never a traceback
    assert r.exit_code in (1, 2) and "Traceback" not in r.output and PASSWORD not in r.output, r.output


def test_mask_secrets() -> None:
    assert mask_secrets("x postgresql://u:p@ss@h:1/db y") == "x postgresql://u:***@h:1/db y"
    assert mask_secrets("amqp://guest:guest@rabbit//") == "amqp://guest:***@rabbit//"
    assert mask_secrets("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


# -- numbers: ASCII digits only ------------------------------------------------------------------------

NON_ASCII_NUMBERS = [
    ["prune", "--published-older-than", "\u0661d"],  # Arabic-Indic 1: int() reads it as 1
    ["prune", "--inbox-older-than", "\uff11h"],  # fullwidth 1
    ["prune", "--published-older-than", "1\u0660d"],  # one ASCII digit and a look-alike
    ["prune", "--published-older-than", "1d", "--batch", "\u0663"],
    ["stats", "--max-pending-age", "\u0665m"],
    ["check", "--timeout", "\u0662s"],
    ["relay", "--once", "--batch-size", "\u0661\u0660"],
    ["relay", "--once", "--max-in-flight", "\u00b2"],  # superscript 2: str.isdigit says yes
    ["relay", "--once", "--poll-interval", "\u0661.5"],
    ["relay", "--once", "--poll-interval", "nan"],
    ["relay", "--once", "--poll-interval", "inf"],
    ["prune", "--published-older-than", "99999999999999d"],
]


@pytest.mark.parametrize("args", NON_ASCII_NUMBERS, ids=lambda a: " ".join(a).encode("unicode_escape").decode())
def test_a_number_in_another_script_is_refused_at_parse(tmp_path: Path, tmp_home: Path, namespace: str,
                                                        args: list[str]) -> None:
    # Given a database with no tables: a command that got past its options would fail there (exit 1)
    env = base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'empty.db'}")
    # When a number is written with digits that are not ASCII (or is not a finite number)
    r = run(env, *args)
    # Then the option is refused: one line, exit 2, before anything ran
    line = assert_one_clean_line(r, exit_code=2)
    assert line.startswith("Error: Invalid value for") and "outbox db upgrade" not in line


@pytest.mark.parametrize(("text", "ms"), [("500ms", 500), ("30s", 30_000), (" 15m ", 900_000), ("2h", 7_200_000),
                                          ("7d", 604_800_000)])
def test_durations_in_ascii_digits_still_parse(text: str, ms: int) -> None:
    from celery_outbox.cli.common import Duration

    assert Duration().convert(text, None, None) == ms


def test_a_bad_setting_is_one_line_with_exit_2_not_a_usage_screen(tmp_path: Path, tmp_home: Path,
                                                                  namespace: str) -> None:
    env = {**base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), "OUTBOX_ROUTES": "A=x;A=y"}
    # (the deployment's module refuses it at import, as every entry point does)
    line = assert_one_clean_line(run(env, "stats"), exit_code=2)
    assert line.startswith("bad configuration: OUTBOX_ROUTES routes 'A' twice")
    # And a configuration the CLI itself refuses is one line too, without click's usage lines
    line = assert_one_clean_line(run(env, "-A", "9not.a.module", "stats"), exit_code=2)
    assert line.startswith("Error: bad configuration: -A")


# -- stored text shown to a person: never rich markup, never a terminal control ---------------------------

# What a hostile producer can put in the text a dead letter keeps (its error, its type): rich markup that does
# not balance, terminal escapes (recolour, retitle, clear), C1 controls, bidi overrides, a lone surrogate.
SHOWN_TEXT = st.lists(st.sampled_from(["[/bold]", "[bold", "[link=http://x]", "[/]", ":smile:", "\x1b[2J", "\x1b]0;t\x07",
                                       "\x9b31m", "\r", "\x08", "\u202e", "\ud800", "a", " ", "[", "]", "\n"]),
                      min_size=1, max_size=12).map("".join)
TERMINAL_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


@hsettings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(error=SHOWN_TEXT, type_=SHOWN_TEXT)
def test_stored_text_is_shown_as_written_and_never_drives_the_terminal(
        sqlite_url: str, tmp_home: Path, namespace: str, tables: Tables, error: str, type_: str) -> None:
    # Given a dead letter of each store whose error and type hold markup and terminal controls
    engine = make_engine(sqlite_url)
    sessions: sessionmaker[Session] = make_session_factory(engine)
    with sessions() as s:
        for table in (tables.outbox, tables.dead_letters):
            s.execute(sa.delete(table))
        s.commit()
        # (no database stores a lone surrogate in a column: the consumer's dead-letter writer keeps it escaped)
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10, last_error=error.replace("\ud800", "?"),
                         type=type_.replace("\ud800", "?")[:200])
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", error=error,
                                   env={"message_id": str(row.message_id), "type": type_, "payload": {}})
        seq, message_id = row.seq, str(row.message_id)
    engine.dispose()
    env = base_env(tmp_home, namespace, sqlite_url)
    # When a person lists, groups, shows and traces them
    for args in (["dead-letters", "list"], ["dead-letters", "groups"], ["dead-letters", "show", f"outbox:{seq}"],
                 ["dead-letters", "show", f"consumer:{cid}"], ["trace", message_id]):
        r = run(env, *args)
        # Then each command answers (a stray "[/bold]" is text, not a tag that fails the listing)
        assert r.exit_code == 0, (args, r.output)
        # And nothing in its output acts on the terminal: controls are shown as escapes
        assert TERMINAL_CONTROL.search(r.output) is None, (args, r.output)
    assert "\\x1b" in run(env, "dead-letters", "show", f"outbox:{seq}").output or "\x1b" not in error


# -- the command line itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("revision", ["bogus", "", "head\n", "-1", "+1", "co0001:co0002", "abc@head", "@", "\x00"])
@pytest.mark.parametrize("command", ["upgrade", "stamp"])
def test_a_revision_that_is_not_one_is_a_usage_error_before_the_database(tmp_path: Path, tmp_home: Path,
                                                                          namespace: str, command: str,
                                                                          revision: str) -> None:
    # Given an empty database
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    # When `outbox db upgrade|stamp --revision` names no revision of the library (a typo, a step, a range)
    r = run(base_env(tmp_home, namespace, url), "db", command, "--revision", revision)
    # Then one line naming the revisions there are, exit 2, and the database was not touched
    line = assert_one_clean_line(r, exit_code=2)
    assert "is not a revision: head" in line and "unexpected" not in line
    assert sa.inspect(make_engine(url)).get_table_names() == []


@pytest.mark.parametrize("args", [[f"postgresql://app:{PASSWORD}@db/app"], ["dead-letters", f"amqp://u:{PASSWORD}@h//"],
                                  ["stats", f"redis://:{PASSWORD}@h:6379/0"], ["stats", "x\x1b]0;title\x07"]])
def test_a_misplaced_argument_is_repeated_masked_and_printable(tmp_path: Path, tmp_home: Path, namespace: str,
                                                               args: list[str]) -> None:
    # Given a URL with a password (or a terminal escape) typed where a command or nothing is expected
    r = run(base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), *args)
    # Then click's usage error repeats it without the password and without the escape
    assert r.exit_code == 2 and "Error: " in r.output, r.output
    assert PASSWORD not in r.output and "\x1b" not in r.output and "Traceback" not in r.output, r.output


def strict_json(text: str) -> Any:
    """JSON as every other parser reads it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("body", ['{"message_id": "m", "payload": NaN}', '{"payload": [Infinity, -Infinity]}',
                                  '{"payload": 1e400}', "NaN", '{"payload": {"a": ' * 100 + "1" + "}" * 100 + "}"])
def test_json_output_is_json_whatever_a_dead_letter_body_holds(sqlite_url: str, tmp_home: Path, namespace: str,
                                                               tables: Tables, body: str) -> None:
    # Given a consumer dead letter whose body Python's json reads but no strict parser does (or nested deep)
    engine = make_engine(sqlite_url)
    with make_session_factory(engine)() as s:
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", body=body)
    engine.dispose()
    env = base_env(tmp_home, namespace, sqlite_url)
    # When a machine reads the dead letters
    listed = run(env, "dead-letters", "list", "--json")
    shown = run(env, "dead-letters", "show", f"consumer:{cid}", "--json")
    # Then each output is JSON a strict parser reads, the body shown as its raw text
    assert listed.exit_code == 0 and shown.exit_code == 0
    assert [d["payload"] for d in strict_json(listed.output)] == [body]
    assert strict_json(shown.output)["payload"] == body


def test_a_purge_to_an_archive_whose_name_is_not_utf8_reports_what_it_did(
        sqlite_url: str, tmp_path: Path, tmp_home: Path, namespace: str, tables: Tables) -> None:
    # Given a group of dead letters, and an archive path with a byte that is not UTF-8 (as a shell passes it)
    engine = make_engine(sqlite_url)
    sessions: sessionmaker[Session] = make_session_factory(engine)
    with sessions() as s:
        for _ in range(2):
            consumer_dead_letter(s, tables=tables, consumer="billing", body="{}", error="e")
        gid = list_groups(s, tables=tables)[0].id
    archive = tmp_path / "dead-\udcff.jsonl"
    # When the group is purged to it
    r = run(base_env(tmp_home, namespace, sqlite_url), "dead-letters", "purge", "--group", gid, "--archive",
            str(archive), "--yes")
    # Then the purge says it archived and deleted them (it did), instead of "unexpected UnicodeEncodeError", exit 1
    assert r.exit_code == 0 and "2 purged" in r.output and "\\udcff" in r.output, r.output
    assert len(archive.read_bytes().splitlines()) == 2
    with sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(tables.dead_letters)) == 0
    engine.dispose()


@pytest.mark.parametrize("age", ["0ms", "0s", "1ms", "23h"])
def test_an_inbox_age_below_the_redelivery_window_is_a_usage_error(sqlite_url: str, tmp_home: Path, namespace: str,
                                                                   tables: Tables, age: str) -> None:
    # Given inbox rows and the default one-day redelivery window (docs/operations.md "Retention" refuses below it)
    engine = make_engine(sqlite_url)
    with make_session_factory(engine)() as s:
        inbox_rows(s, tables=tables, consumer="billing", processed_at_ms=0, n=3)
        s.commit()
    # When a prune asks for less (0ms included: the docs give it no meaning of "everything")
    r = run(base_env(tmp_home, namespace, sqlite_url), "prune", "--inbox-older-than", age)
    # Then a bad flag: one line, exit 2 (usage), and nothing was deleted
    line = assert_one_clean_line(r, exit_code=2)
    assert line.startswith("Error: --inbox-older-than: refusing to prune") and "redelivery window" in line
    with make_session_factory(engine)() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(tables.inbox)) == 3
    engine.dispose()


USAGE_ERRORS = [["nosuch"], ["stats", "--bogus"], ["stats", "--jsn"], ["trace", "-0"], ["trace"], ["dead-letters", "replay"],
                ["dead-letters", "nosuch"], ["dead-letters", "purge", "outbox:1"], ["prune"], ["prune", "--inbox-older-than"],
                ["db", "nosuch"], ["db", "partitions", "convert", "--by", "day"], ["relay", "--once", "extra"],
                ["-A"], ["stats", "--json", "--json=1"]]


@pytest.mark.parametrize("args", USAGE_ERRORS, ids=" ".join)
def test_a_usage_error_is_one_line_naming_the_help(tmp_path: Path, tmp_home: Path, namespace: str,
                                                   args: list[str]) -> None:
    # Given a command line click refuses (an unknown command or option, a missing value, options that do not go
    # together)
    r = run(base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), *args)
    # Then one line and exit 2 (docs/operations.md "Probes and exit codes"), not click's usage lines above it
    line = assert_one_clean_line(r, exit_code=2)
    assert line.startswith("Error: ") and "Usage:" not in r.output


@pytest.mark.parametrize("args", [[], ["dead-letters"], ["db"], ["db", "partitions"]], ids=" ".join)
def test_a_group_without_a_command_shows_its_help(tmp_path: Path, tmp_home: Path, namespace: str,
                                                  args: list[str]) -> None:
    # Given a group named without a command; Then its help (click's answer), never an "Error: Usage: ..." around it
    r = run(base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), *args)
    assert r.output.startswith("Usage: ") and "Error" not in r.output and "Commands:" in r.output, r.output


MALFORMED_ARGUMENTS = [["dead-letters", "show", "{}"], ["dead-letters", "replay", "{}"], ["dead-letters", "purge", "{}", "--yes"],
                       ["dead-letters", "replay", "--group", "{}"], ["dead-letters", "purge", "--group", "{}", "--yes"],
                       ["trace", "{}"]]
HOSTILE_TEXT = st.one_of(st.sampled_from(["", " ", "-", "\x00", "a\x00b", "\u202e", "\x1b[2J", "9" * 5000, "\ud800",
                                          f"postgresql://u:{PASSWORD}@h/db"]), st.text(max_size=40))


def refused_by_its_form(template: list[str], raw: str) -> bool:
    check = check_key if template[0] == "trace" else check_group_id if "--group" in template else DeadLetterId.parse
    try:
        check(raw)
    except ValidationError:
        return True
    return False


def a_malformed_argument_is_a_usage_error(sqlite_url: str, tmp_home: Path, namespace: str, template: list[str],
                                          raw: str) -> None:
    """``raw`` where the command takes an id, a group id or a key: one the library's check refuses by its form
    is refused at parse, exit 2 (docs/operations.md "Probes and exit codes"), never 1 as a failed command."""
    if not refused_by_its_form(template, raw):
        return
    r = run(base_env(tmp_home, namespace, sqlite_url), *[raw if a == "{}" else a for a in template])
    line = assert_one_clean_line(r, exit_code=2)
    assert line.startswith(("Error: Invalid value for ", "Error: Missing argument", "Error: No such option"))
    assert "\x1b" not in r.output and "\u202e" not in r.output


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template=st.sampled_from(MALFORMED_ARGUMENTS), raw=HOSTILE_TEXT)
def test_a_malformed_argument_is_a_usage_error(sqlite_url: str, tmp_home: Path, namespace: str, template: list[str],
                                               raw: str) -> None:
    a_malformed_argument_is_a_usage_error(sqlite_url, tmp_home, namespace, template, raw)


@pytest.mark.parametrize("template", MALFORMED_ARGUMENTS, ids=" ".join)
def test_each_malformed_argument_is_a_usage_error(sqlite_url: str, tmp_home: Path, namespace: str,
                                                  template: list[str]) -> None:
    for raw in [*LOOKALIKES, *BLANKED, "", "\x1b[2J", "9" * 5000, f"postgresql://u:{PASSWORD}@h/db"]:
        a_malformed_argument_is_a_usage_error(sqlite_url, tmp_home, namespace, template, raw)


@pytest.mark.parametrize(("args", "flag"), [
    (["--batch-size", "999999999999999999"], "--batch-size"), (["--batch-size", "20000"], "--batch-size"),
    (["--max-in-flight", "999999999999999999"], "--max-in-flight"), (["--poll-interval", "999999999999"], "--poll-interval"),
    (["--poll-interval", "0.005"], "--poll-interval"),  # past the option's own floor, below the setting's
    (["--batch-size", "5", "--max-in-flight", "1"], "--batch-size, --max-in-flight"),
    (["--max-in-flight", "50"], "--max-in-flight"),  # below the OUTBOX_RELAY_BATCH_SIZE in force (100)
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_relay_option_is_judged_by_its_settings_rule_and_named(tmp_path: Path, tmp_home: Path, namespace: str,
                                                                  args: list[str], flag: str) -> None:
    # Given a relay option its setting's rule (or a relation between settings) refuses
    r = run(base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), "relay", "--once", *args)
    # Then one line, exit 2, naming the option given, not an OUTBOX_* variable as if the environment were wrong
    line = assert_one_clean_line(r, exit_code=2)
    assert line.startswith((f"Error: Invalid value for '{flag}'", f"Error: {flag} with the settings")), line
    assert "bad configuration" not in line


def an_unknown_consumer_is_a_bad_option(env: dict[str, str], raw: str) -> None:
    """``--consumer raw`` naming none of the app's consumers: one line, exit 2, before the database (the database of
    ``env`` has no tables: a command that reached it would say so, exit 1)."""
    if raw in ("shipping", "billing", "search"):
        return
    for args in (["dead-letters", "list", "--consumer", raw], ["dead-letters", "replay", "--all", "--consumer", raw]):
        line = assert_one_clean_line(run(env, *args), exit_code=2)
        assert line.startswith("Error: Invalid value for '--consumer': unknown consumer "), line
        assert "\x1b" not in line and "\u202e" not in line


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=HOSTILE_TEXT)
def test_an_unknown_consumer_is_a_bad_option(tmp_path: Path, tmp_home: Path, namespace: str, raw: str) -> None:
    an_unknown_consumer_is_a_bad_option(base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'empty.db'}"), raw)


def test_each_unknown_consumer_is_a_bad_option(tmp_path: Path, tmp_home: Path, namespace: str) -> None:
    env = base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'empty.db'}")
    for raw in ["", " ", "shiping", "Shipping", "shipping ", "\x1b[2J", "9" * 5000, f"postgresql://u:{PASSWORD}@h/db"]:
        an_unknown_consumer_is_a_bad_option(env, raw)


@pytest.mark.parametrize(("args", "flag"), [
    (["ensure", "--ahead", "1001"], "--ahead"), (["convert", "--ahead", "999999999999999999"], "--ahead"),
    (["convert", "--size", "999999999999999999"], "--size"),  # its ranges would leave BIGINT: a database error
    (["convert", "--size", "999"], "--size"),
], ids=" ".join)
def test_a_partition_option_past_its_bounds_is_refused_at_parse(tmp_path: Path, tmp_home: Path, namespace: str,
                                                                args: list[str], flag: str) -> None:
    r = run(base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), "db", "partitions", *args)
    line = assert_one_clean_line(r, exit_code=2)
    assert line.startswith(f"Error: Invalid value for '{flag}'"), line


def test_the_partition_bounds_keep_every_range_inside_bigint(tables: Tables,
                                                             sqlite_sessions: sessionmaker[Session]) -> None:
    # Given the largest partitions the options allow; Then every range above any seq a table reaches stays in BIGINT
    assert (ops_partitions.MAX_AHEAD + 2) * ops_partitions.MAX_SIZE < 2**63 // 1000
    # And the library refuses a larger one given in code, before it touches the database
    with pytest.raises(ConfigError, match="partition size"):
        ops_partitions.convert(sqlite_sessions, tables=tables, size=ops_partitions.MAX_SIZE + 1)


@pytest.mark.parametrize("stored", ['{"x": 1e400}', '{"x": [1e999, -1e999]}', '{"x": {"y": -1e400}}'])
def test_json_output_is_strict_json_whatever_a_row_holds(sqlite_url: str, tmp_home: Path, namespace: str,
                                                         tables: Tables, stored: str) -> None:
    # Given a dead letter whose stored headers hold valid JSON that Python reads as an infinite float (the column's
    # json_valid check takes it; Postgres' jsonb too), written by hand
    engine = make_engine(sqlite_url)
    with make_session_factory(engine)() as s:
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", error="e")
        s.execute(sa.update(tables.dead_letters).where(tables.dead_letters.id == cid)
                  .values(headers=sa.literal(stored, sa.Text())))  # the text as written, not encoded again
        s.commit()
    engine.dispose()
    env = base_env(tmp_home, namespace, sqlite_url)
    # When a machine reads it; Then strict JSON, the number shown by its name
    for args in (["dead-letters", "show", f"consumer:{cid}", "--json"], ["dead-letters", "list", "--json"]):
        r = run(env, *args)
        assert r.exit_code == 0, r.output
        strict_json(r.output)


@pytest.mark.parametrize(("flag", "wanted"), [("", False), ("0", False), ("false", False), ("no", False),
                                              ("1", True), ("true", True), ("YES", True)])
def test_the_traceback_is_asked_for_by_name_and_masked(tmp_path: Path, tmp_home: Path, namespace: str,
                                                       monkeypatch: pytest.MonkeyPatch, flag: str, wanted: bool) -> None:
    # Given an app module that fails at import with an error that quotes a URL with its password
    monkeypatch.syspath_prepend(str(tmp_path))
    module = f"failing_app_{len(flag)}_{wanted}"
    (tmp_path / f"{module}.py").write_text(f'raise ValueError("cannot reach postgresql://app:{PASSWORD}@db/app")\n')
    env = {**base_env(tmp_home, namespace, f"sqlite:///{tmp_path / 'x.db'}"), "OUTBOX_TRACEBACK": flag}
    r = run(env, "-A", module, "stats")
    # Then exit 1; the traceback only when OUTBOX_TRACEBACK says yes ("0" is no), and never the password
    assert r.exit_code == 1 and PASSWORD not in r.output, r.output
    if wanted:
        assert r.output.startswith("Traceback (most recent call last):") and "postgresql://app:***@db/app" in r.output
    else:
        assert_one_clean_line(r)


# An HTTP client's error quotes the URL it called, credentials and all (requests, urllib3, httpx do).
LEAKY_ERROR = f"ConnectionError: HTTPSConnectionPool: Max retries exceeded with url https://api:{PASSWORD}@pay.example/v1"


def test_a_consumer_error_quoting_a_url_password_is_kept_masked(sqlite_url: str, tables: Tables) -> None:
    # Given a consumer whose handler failed with an error that quotes a URL with its password
    assert PASSWORD not in _error_text(ValueError(LEAKY_ERROR))  # what a retry records
    engine = make_engine(sqlite_url)
    with make_session_factory(engine)() as s:
        consumer_dead_letters.record(s, tables=tables, consumer="billing", message_id="m", type="T", body="{}",
                                     headers={}, delivery_count=3, last_error=LEAKY_ERROR, first_failed_at_ms=T0,
                                     last_failed_at_ms=T0)
        s.commit()
        # Then the dead-letter store keeps it masked: no reader (CLI, admin pages, Flower's events) can show it
        stored = s.scalars(sa.select(tables.dead_letters.last_error)).one()
    engine.dispose()
    assert PASSWORD not in stored and "https://api:***@pay.example/v1" in stored


def test_a_stored_error_quoting_a_url_password_is_shown_masked(sqlite_url: str, tmp_home: Path, namespace: str,
                                                               tables: Tables) -> None:
    # Given dead letters of both stores whose error texts quote a password (kept so before the store masked them,
    # or written by the relay from a broker's error)
    engine = make_engine(sqlite_url)
    with make_session_factory(engine)() as s:
        row = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10, last_error=LEAKY_ERROR)
        cid = consumer_dead_letter(s, tables=tables, consumer="billing", error="e")
        s.execute(sa.update(tables.dead_letters).values(last_error=LEAKY_ERROR))
        s.commit()
        seq = row.seq
    engine.dispose()
    env = base_env(tmp_home, namespace, sqlite_url)
    # When a person or a machine reads them; Then no output holds the password
    for args in (["dead-letters", "list"], ["dead-letters", "list", "--json"], ["dead-letters", "groups"],
                 ["dead-letters", "groups", "--json"], ["dead-letters", "show", f"outbox:{seq}"],
                 ["dead-letters", "show", f"consumer:{cid}", "--json"], ["dead-letters", "show", f"consumer:{cid}"]):
        r = run(env, *args)
        assert r.exit_code == 0 and PASSWORD not in r.output, (args, r.output)


def test_a_dead_lettered_event_never_carries_a_url_password(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given Celery's event dispatch recorded (Flower shows these events' fields)
    from celery_outbox.celery import events

    sent: list[dict[str, Any]] = []

    def record(app: Any, type: str, **fields: Any) -> bool:
        sent.append(fields)
        return True

    monkeypatch.setattr(events, "send_event", record)
    # When a dead letter is announced whose error quotes a URL with its password, past the 500 characters shown
    events.dead_lettered(None, source="outbox", message_id="m", error="x" * 400 + " " + LEAKY_ERROR)  # type: ignore[arg-type]
    # Then the event's error is masked before it is cut: neither the password nor its start is in it
    assert PASSWORD[:6] not in sent[0]["error"] and "https://api:***@pay" in sent[0]["error"]
