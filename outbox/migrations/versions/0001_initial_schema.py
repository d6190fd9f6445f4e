"""initial schema: orders, outbox (+ NOTIFY trigger on Postgres), inbox and consumer tables

Revision ID: 0001
Revises:
Create Date: 2026-12-02 12:53:00.204647
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('consumer_attempts',
    sa.Column('message_id', sa.Uuid(), nullable=False),
    sa.Column('consumer', sa.String(length=64), nullable=False),
    sa.Column('deliveries', sa.Integer(), nullable=False),
    sa.Column('first_failed_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('last_failed_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('message_id', 'consumer')
    )
    op.create_table('consumer_counters',
    sa.Column('consumer', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('consumer', 'name')
    )
    op.create_table('consumer_dead_letters',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=False), nullable=False),
    sa.Column('consumer', sa.String(length=64), nullable=False),
    sa.Column('message_id', sa.String(length=64), nullable=False),
    sa.Column('type', sa.String(length=200), nullable=True),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('headers', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('delivery_count', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=False),
    sa.Column('first_failed_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('last_failed_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('replayed_at_ms', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('consumer_dead_letters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_consumer_dead_letters_consumer'), ['consumer'], unique=False)

    op.create_table('consumer_entity_versions',
    sa.Column('consumer', sa.String(length=64), nullable=False),
    sa.Column('entity_key', sa.String(length=200), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('consumer', 'entity_key')
    )
    op.create_table('inbox',
    sa.Column('message_id', sa.Uuid(), nullable=False),
    sa.Column('consumer', sa.String(length=64), nullable=False),
    sa.Column('type', sa.String(length=200), nullable=False),
    sa.Column('processed_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('message_id', 'consumer')
    )
    with op.batch_alter_table('inbox', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_inbox_processed_at_ms'), ['processed_at_ms'], unique=False)

    op.create_table('invoices',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=False), nullable=False),
    sa.Column('order_id', sa.String(length=64), nullable=False),
    sa.Column('amount_cents', sa.BigInteger(), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('created_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('invoices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_invoices_order_id'), ['order_id'], unique=False)

    op.create_table('orders',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('customer_id', sa.String(length=64), nullable=False),
    sa.Column('email', sa.String(length=320), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('total_cents', sa.BigInteger(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('created_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('outbox',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=False), nullable=False),
    sa.Column('message_id', sa.Uuid(), nullable=False),
    sa.Column('type', sa.String(length=200), nullable=False),
    sa.Column('payload', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('headers', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('published_at_ms', sa.BigInteger(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('dead_lettered_at_ms', sa.BigInteger(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('message_id')
    )
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.create_index('ix_outbox_pending', ['seq'], unique=False, postgresql_where=sa.text('published_at_ms IS NULL AND dead_lettered_at_ms IS NULL'), sqlite_where=sa.text('published_at_ms IS NULL AND dead_lettered_at_ms IS NULL'))
        batch_op.create_index('ix_outbox_published', ['published_at_ms'], unique=False, postgresql_where=sa.text('published_at_ms IS NOT NULL'), sqlite_where=sa.text('published_at_ms IS NOT NULL'))

    op.create_table('parked_messages',
    sa.Column('message_id', sa.Uuid(), nullable=False),
    sa.Column('consumer', sa.String(length=64), nullable=False),
    sa.Column('entity_key', sa.String(length=200), nullable=False),
    sa.Column('entity_version', sa.BigInteger(), nullable=False),
    sa.Column('envelope', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('parked_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('message_id', 'consumer')
    )
    with op.batch_alter_table('parked_messages', schema=None) as batch_op:
        batch_op.create_index('ix_parked_entity', ['consumer', 'entity_key', 'entity_version'], unique=False)

    op.create_table('search_documents',
    sa.Column('order_id', sa.String(length=64), nullable=False),
    sa.Column('body', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('updated_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('order_id')
    )
    op.create_table('sent_emails',
    sa.Column('idempotency_key', sa.String(length=100), nullable=False),
    sa.Column('to', sa.String(length=320), nullable=False),
    sa.Column('subject', sa.String(length=500), nullable=False),
    sa.Column('calls', sa.Integer(), nullable=False),
    sa.Column('sent_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('idempotency_key')
    )
    op.create_table('shipments',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=False), nullable=False),
    sa.Column('order_id', sa.String(length=64), nullable=False),
    sa.Column('address_line', sa.String(length=500), nullable=False),
    sa.Column('items', sa.Integer(), nullable=False),
    sa.Column('created_at_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('shipments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_shipments_order_id'), ['order_id'], unique=False)

    op.create_table('order_lines',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=False), nullable=False),
    sa.Column('order_id', sa.String(length=64), nullable=False),
    sa.Column('sku', sa.String(length=64), nullable=False),
    sa.Column('quantity', sa.Integer(), nullable=False),
    sa.Column('unit_price_cents', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['order_id'], ['orders.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('order_lines', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_order_lines_order_id'), ['order_id'], unique=False)

    if op.get_bind().dialect.name == "postgresql":
        # Wakes a standalone relay (LISTEN outbox_pending) the moment an event commits.
        op.execute(
            "CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger AS $$ "
            "BEGIN PERFORM pg_notify('outbox_pending', ''); RETURN NULL; END $$ LANGUAGE plpgsql"
        )
        op.execute(
            "CREATE TRIGGER outbox_notify AFTER INSERT ON outbox "
            "FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS outbox_notify ON outbox")
        op.execute("DROP FUNCTION IF EXISTS outbox_notify()")
    with op.batch_alter_table('order_lines', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_order_lines_order_id'))

    op.drop_table('order_lines')
    with op.batch_alter_table('shipments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_shipments_order_id'))

    op.drop_table('shipments')
    op.drop_table('sent_emails')
    op.drop_table('search_documents')
    with op.batch_alter_table('parked_messages', schema=None) as batch_op:
        batch_op.drop_index('ix_parked_entity')

    op.drop_table('parked_messages')
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index('ix_outbox_published', postgresql_where=sa.text('published_at_ms IS NOT NULL'), sqlite_where=sa.text('published_at_ms IS NOT NULL'))
        batch_op.drop_index('ix_outbox_pending', postgresql_where=sa.text('published_at_ms IS NULL AND dead_lettered_at_ms IS NULL'), sqlite_where=sa.text('published_at_ms IS NULL AND dead_lettered_at_ms IS NULL'))

    op.drop_table('outbox')
    op.drop_table('orders')
    with op.batch_alter_table('invoices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_invoices_order_id'))

    op.drop_table('invoices')
    with op.batch_alter_table('inbox', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_inbox_processed_at_ms'))

    op.drop_table('inbox')
    op.drop_table('consumer_entity_versions')
    with op.batch_alter_table('consumer_dead_letters', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_consumer_dead_letters_consumer'))

    op.drop_table('consumer_dead_letters')
    op.drop_table('consumer_counters')
    op.drop_table('consumer_attempts')
