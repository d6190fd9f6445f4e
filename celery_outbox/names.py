"""The rule for a consumer's name, shared by declarations (``consumer``) and settings (routes).

A consumer name is its queue suffix, its task name and its inbox key, so it is short and plain. Kept
in a module of its own so the lowest layer (settings) can use it without importing the consumer layer.
"""

from __future__ import annotations

import re

from celery_outbox.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def check_name(name: object) -> str:
    """A consumer name is its queue suffix, task name and inbox key: short and plain."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"consumer name {name!r} must be 1-64 letters, digits, '_' or '-', starting with a "
                          "letter or digit")
    return name
