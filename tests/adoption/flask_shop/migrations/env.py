"""The team's OWN Alembic environment: its tables, its default version table (alembic_version)."""

from alembic import context
from shop.app import Base, create
from sqlalchemy import create_engine

from celery_outbox import alembic_filters

create(context.config.get_main_option("sqlalchemy.url") or "", "memory://")  # define the outbox tables into Base.metadata
target_metadata = Base.metadata

engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=target_metadata, **alembic_filters())
    with context.begin_transaction():
        context.run_migrations()
