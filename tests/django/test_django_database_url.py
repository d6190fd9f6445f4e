"""A Django database entry becomes the outbox's SQLAlchemy URL; a bad port is one clean error, never a traceback."""

from __future__ import annotations

import pytest

from celery_outbox.contrib.django.conf import url_of
from celery_outbox.errors import ConfigError

PG = "django.db.backends.postgresql"


def test_a_postgres_entry_becomes_its_url() -> None:
    entry = {"ENGINE": PG, "USER": "app", "PASSWORD": "s3cret", "HOST": "db", "PORT": "6432", "NAME": "shop"}
    assert url_of(entry, "default") == "postgresql://app:s3cret@db:6432/shop"
    assert url_of({**entry, "PORT": 5433}, "default").endswith("@db:5433/shop")
    assert url_of({**entry, "PORT": ""}, "default") == "postgresql://app:s3cret@db/shop"


@pytest.mark.parametrize("port", ["١٢", "abc", "0", "70000", "-1", "5432x", "²"])
def test_a_port_that_is_not_ascii_digits_in_range_is_refused_naming_the_alias(port: str) -> None:
    # Given a DATABASES entry whose PORT is not a port (Unicode digits included: int() would accept "١٢")
    entry = {"ENGINE": PG, "USER": "app", "PASSWORD": "s3cret", "HOST": "db", "PORT": port, "NAME": "shop"}
    # When the outbox builds its URL, Then one ConfigError names the alias and the rule, never the password
    with pytest.raises(ConfigError, match=r"'other' has PORT .*1-65535 in ASCII digits") as raised:
        url_of(entry, "other")
    assert "s3cret" not in str(raised.value)
