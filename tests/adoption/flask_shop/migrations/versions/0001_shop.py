"""The team's own first migration: orders (which already existed), notifications and confirmations.

Revision ID: shop0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "shop0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("orders", sa.Column("id", sa.String(64), primary_key=True), if_not_exists=True)
    op.create_table("notifications", sa.Column("order_id", sa.String(64), primary_key=True))
    op.create_table("confirmations", sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                    sa.Column("order_id", sa.String(64), nullable=False))


def downgrade() -> None:
    op.drop_table("confirmations")
    op.drop_table("notifications")
    op.drop_table("orders")
