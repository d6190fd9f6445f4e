"""Create this deployment's tables: the library's (``celery_outbox`` migrations) and its own (Orders)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from celery_outbox import migrate_database

MIGRATIONS = Path(__file__).parent / "migrations"


def upgrade(url: str) -> None:
    """Both sets of migrations, each with its own version table."""
    migrate_database(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(cfg, "head")
