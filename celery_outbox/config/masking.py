"""Secrets never shown: a URL's password masked, a configuration error as one masked line at an entry point."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from celery_outbox.errors import ConfigError

MASK = "***"

_SECRET_QUERY = re.compile(r"(?i)([?&;](?:password|passwd|pwd|pass|secret|token|api_key|apikey|sslpassword|"
                           r"sslkey|access_key|secret_key)=)[^&;#]*")


def mask_url(url: str) -> str:
    """``url`` with its password (and any password-like query parameter) replaced by ``***``.

    Conservative: everything between the user name and the last ``@`` before the path is hidden, so
    a password with an unescaped ``@`` or ``/`` is hidden too; several URLs separated by ``;``
    (kombu failover) are masked one by one.
    """
    if ";" in url and "://" in url.split(";", 1)[1]:
        return ";".join(mask_url(part) for part in url.split(";"))
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL: hide whatever could be user info
        at = url.rfind("@")
        return _SECRET_QUERY.sub(rf"\1{MASK}", url if at < 0 else MASK + url[at:])
    at = rest.rfind("@")
    if at >= 0:
        userinfo, host = rest[:at], rest[at + 1:]
        user, colon, _password = userinfo.partition(":")
        if "/" in user:  # an unescaped '/' in the user info: hide all of it
            user, colon = MASK, ""
        rest = f"{user}:{MASK}@{host}" if colon else f"{user}@{host}"
    return _SECRET_QUERY.sub(rf"\1{MASK}", f"{scheme}://{rest}")


# ``scheme://user:password@`` anywhere in free text (an error message, a repr): up to the token's last ``@``, so a
# password holding ``@`` or ``/`` is hidden whole; a quote or a blank ends the token (a repr, a sentence).
# A match is tried once per run of scheme characters, from its start (the lookbehind), the scheme beginning at the
# run's first letter, as the leftmost match would: tried at every position, each attempt scanned to the run's
# end, and a 100 KB value took seconds per setting.
_SCHEME = r"(?<![A-Za-z0-9+.-])[0-9+.-]*[A-Za-z][A-Za-z0-9+.-]*://"
_URL_CREDENTIALS = re.compile(rf"""(?P<head>{_SCHEME}[^\s:/?#@'"]*):(?P<password>[^\s'"]*)@""")
_MIN_SCRUBBED = 4  # a shorter password is masked where it stands in its URL, not searched for in the whole text
# The same, password up to the FIRST ``@`` (or ``;``): in a kombu failover list given as one value the greedy
# match spans the next URL, and a message quoting part of the value quotes each password on its own.
_URL_CREDENTIALS_SHORT = re.compile(rf"""{_SCHEME}[^\s:/?#@'"]*:(?P<password>[^\s@'";]*)@""")


def mask_secrets(text: str, *, source: str = "") -> str:
    """``text`` with every URL password replaced by ``***``: the one masking of free text (error messages,
    driver errors, command output). ``source``: the value the text was made from (a setting's raw value);
    its URL passwords are also hidden wherever else they appear in ``text`` (a message quoting part of it)."""
    found = {m.group("password") for pattern, token in ((_URL_CREDENTIALS, _TOKEN), (_URL_CREDENTIALS_SHORT, _SEGMENT))
             for start, end in _stretches(source, token) for m in pattern.finditer(source[start:end])}
    for password in sorted(found, key=len, reverse=True):  # the longest first: a shorter one may be part of it
        if len(password) >= _MIN_SCRUBBED:
            text = text.replace(password, MASK)
    parts, done = [], 0
    for start, end in _stretches(text, _TOKEN):
        parts += [text[done:start], _URL_CREDENTIALS.sub(lambda m: f"{m.group('head')}:{MASK}@", text[start:end])]
        done = end
    return "".join([*parts, text[done:]])


# Where a ``scheme://user:password@`` can stand: no match of the patterns above crosses a blank or a quote (nor a
# ``;`` for the short one's password, which is all it is used for), and every match ends with an ``@``.
_TOKEN = re.compile(r"""[^\s'"]+""")
_SEGMENT = re.compile(r"""[^\s'";]+""")


def _stretches(text: str, token: re.Pattern[str]) -> Iterator[tuple[int, int]]:
    """Each ``token`` of ``text`` that holds ``://``, cut after its last ``@``: the patterns run there only, where
    every attempt that reaches a password ends at an ``@``. Run on the whole text, each attempt scanned on to
    the end of its token and failed, once per ``scheme://user:`` in it: a 180 KB value of ``a://b:`` took over a
    minute to mask."""
    for m in token.finditer(text):
        start, end = m.span()
        at = text.rfind("@", start, end)
        if at >= 0 and text.find("://", start, at) >= 0:
            yield start, at + 1


def bounded_repr(value: Any, limit: int = 80) -> str:
    """One line, bounded: a value as an error message shows it, URL passwords masked before it is cut (a cut
    URL loses the ``@`` that marks its password)."""
    text = mask_secrets(repr(value))
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


@contextmanager
def exit_on_config_error(code: int = 2) -> Iterator[None]:
    """At an entry point (a Celery ``-A`` module, a WSGI module): a ``ConfigError`` becomes one line
    ``bad configuration: ...`` on stderr and exit status ``code`` (2, like the ``outbox`` CLI), never
    a traceback. Under gunicorn pass ``code=4``: its master stops on a worker that exits 4 ("App
    failed to load") instead of starting workers again for ever.
    """
    try:
        yield
    except ConfigError as e:
        _exit(e, code)


def _exit(error: ConfigError, code: int) -> NoReturn:
    # one line whatever the message holds, and no URL password even from an error raised elsewhere
    message = mask_secrets(" ".join(str(error).split()))
    sys.stderr.write(f"bad configuration: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code) from None
