"""Every ``OUTBOX_*`` variable under hostile values: one ``ConfigError`` line naming the variable, bounded, and
never a URL password, even when the URL was given to a setting that is not a URL (a value pasted into the wrong
variable is no less a secret). Any other exception, or a value accepted and then failing later, is a defect."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from celery_outbox.config.declare import variable
from celery_outbox.config.masking import bounded_repr, mask_secrets
from celery_outbox.errors import ConfigError
from celery_outbox.settings import Settings

PASSWORD = "pw-Never-Shown-9"
VARIABLES = sorted(variable(f.name) for f in dataclasses.fields(Settings))
# URLs with credentials in the shapes a pasted value has: a password holding '@' or '/', a kombu failover list, a
# URL a parser refuses, one wrapped in text, one long enough to be cut when shown
URLS = [f"postgresql://app:{PASSWORD}@db:5432/app", f"postgresql+psycopg://app:{PASSWORD}@/app",
        f"redis://:{PASSWORD}@[::1", f"amqp://u:{PASSWORD}@h:abc//", f"sentinel://:{PASSWORD}@s1:26379/0",
        f"amqp://u:{PASSWORD}@n1//;amqp://u:{PASSWORD}@n2//", f"postgresql://app:a@{PASSWORD}@db/app",
        f"postgresql://app:{PASSWORD}/x@db/app", f"after_mark,postgresql://app:{PASSWORD}@db/app@2",
        f"A=x;B=postgresql://app:{PASSWORD}@db", f"postgresql://{'u' * 70}:{PASSWORD}@db/app"]
NOISE = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)


def assert_clean(e: ConfigError, key: str) -> None:
    message = str(e)
    assert PASSWORD not in message and PASSWORD[:8] not in message, message
    assert "\n" not in message and key in message and len(message) < 2000, message


def read_cleanly(key: str, raw: str) -> None:
    """The environment ``{key: raw}`` is accepted, or refused in one clean line without the password."""
    try:
        Settings.from_env({key: raw})
    except ConfigError as e:
        assert_clean(e, key)


@hsettings(max_examples=300, deadline=None)
@given(key=st.sampled_from(VARIABLES), url=st.sampled_from(URLS), before=NOISE, after=NOISE)
def test_a_url_password_is_never_in_a_configuration_error(key: str, url: str, before: str, after: str) -> None:
    # Given a URL with a password, maybe wrapped in other text, in any OUTBOX_* variable
    # When the settings are read; Then either they are accepted or one clean line refuses them
    read_cleanly(key, before + url + after)


@pytest.mark.parametrize("url", URLS)
def test_each_url_in_each_variable_is_refused_without_its_password(url: str) -> None:
    # Given each URL shape alone in each OUTBOX_* variable (the property above draws them at random)
    for key in VARIABLES:
        read_cleanly(key, url)


@pytest.mark.parametrize("key", VARIABLES)
def test_a_value_given_in_code_is_refused_without_its_password(key: str) -> None:
    # Given a URL with a password passed in code to a setting that is not a URL (or to one with a bad port)
    name = next(f.name for f in dataclasses.fields(Settings) if variable(f.name) == key)
    for value in (f"postgresql://app:{PASSWORD}@db:99999/app", f"xx://u:{PASSWORD}@" + "h" * 90):
        try:
            Settings.from_env({}, **{name: value})
        except ConfigError as e:
            assert_clean(e, key)


def test_a_shown_value_is_masked_before_it_is_cut() -> None:
    # Given a URL whose '@' lies past the length a message shows
    url = f"postgresql://{'u' * 60}:{PASSWORD}@db/app"
    # Then the shown value never holds the start of the password
    assert PASSWORD[:4] not in bounded_repr(url) and bounded_repr(url).endswith("...(truncated)")
    assert mask_secrets("x postgresql://u:p@ss@h:1/db y") == "x postgresql://u:***@h:1/db y"
    assert mask_secrets(f"point 'postgresql://u:{PASSWORD}'", source=f"postgresql://u:{PASSWORD}@h") == \
        "point 'postgresql://u:***'"


# -- a huge value ------------------------------------------------------------------------------------------------

# The shapes that made masking quadratic: a long run of scheme characters, and many ``scheme://user:`` in one token
# (each attempt scanned on to the end of its token); a megabyte of either took minutes per variable.
HUGE = ["x" * 1_000_000, "x1" * 500_000, "a://b:" * 100_000, "a://b:" * 100_000 + ";@", "@" + "a://b:" * 100_000,
        "a://b:" * 100_000 + f"{PASSWORD}@h/app"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", HUGE, ids=lambda v: f"{v[:8]!r}x{len(v)}")
def test_a_huge_value_in_any_variable_is_read_cleanly(value: str) -> None:
    # Given a value of a megabyte or so in each OUTBOX_* variable; Then each is accepted or refused in one clean
    # line (before the fix, masking the refusal took minutes per variable and the timeout failed the test)
    for key in VARIABLES:
        read_cleanly(key, value)


# The masking of free text as it was before the stretches, on the whole text at once: the reference it must match.
_REFERENCE = re.compile(r"""(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@'"]*):(?P<password>[^\s'"]*)@""")
URL_TEXT = st.lists(st.sampled_from(["a", "x9", "-", "+", ".", "é", "://", ":", "@", "/", ";", " ", "'", '"', "pw",
                                     "postgresql", "\n", "?", "#"]), max_size=25).map("".join)


@hsettings(max_examples=1000, deadline=None)
@given(text=URL_TEXT)
def test_masking_free_text_is_the_whole_text_masking(text: str) -> None:
    # Given text made of URL pieces; Then masking it by stretches hides exactly what masking it whole did
    assert mask_secrets(text) == _REFERENCE.sub(lambda m: f"{m.group('head')}:***@", text)


@pytest.mark.parametrize("text", ["é-postgresql://u:pw@h", "x9postgresql://u:pw@h", "9-x://u:pw@h", "'a://u:pw@h'",
                                  "a://u:p@w@h b://v:q@h", "@ a://u:pw@h", "a://u:pw@h@", "-+.://u:pw@h"])
def test_masking_free_text_is_the_whole_text_masking_at_the_edges(text: str) -> None:
    assert mask_secrets(text) == _REFERENCE.sub(lambda m: f"{m.group('head')}:***@", text)
