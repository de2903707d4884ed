"""who revoked a token

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every mutating route records who acted; a revocation recorded only when. Tokens revoked
    # before this revision keep an empty ``revoked_by``.
    op.add_column("api_tokens", sa.Column("revoked_by", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("revoked_by")
