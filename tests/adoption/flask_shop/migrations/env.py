"""The team's OWN Alembic environment: its tables, its default version table (alembic_version)."""

from alembic import context
from shop.app import Base  # importing the app module puts the outbox tables into Base.metadata
from sqlalchemy import create_engine

from celery_outbox import alembic_filters

target_metadata = Base.metadata

engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=target_metadata, **alembic_filters())
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
