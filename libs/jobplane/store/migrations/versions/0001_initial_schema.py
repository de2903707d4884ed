"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Frozen copy of the instance states at this revision (migrations never import app code).
STATES = ", ".join(
    f"'{state}'"
    for state in (
        "scheduled",
        "enqueued",
        "processing",
        "succeeded",
        "failed",
        "terminated",
        "skipped",
        "cancelled",
    )
)


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    clock = sa.text("clock_timestamp()" if postgres else "(strftime('%Y-%m-%d %H:%M:%f', 'now'))")
    # Fencing tokens of claims; SQLite has no sequences and uses the ``counters`` row instead.
    if postgres:
        op.execute(sa.schema.CreateSequence(sa.Sequence("claim_token_seq")))

    op.create_table(
        "counters",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_counters")),
    )
    op.execute("INSERT INTO counters (name, value) VALUES ('claim_token', 0)")
    op.create_table(
        "instance_transitions",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
        ),
        sa.Column("instance_id", sa.Uuid(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        # clock_timestamp(), not now(): now() is the start of the transaction.
        sa.Column("at", sa.DateTime(timezone=True), server_default=clock, nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("claim_token", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_instance_transitions")),
    )
    op.create_index("ix_instance_transitions_at", "instance_transitions", ["at"], unique=False)
    op.create_index(
        "ix_instance_transitions_instance_id_seq",
        "instance_transitions",
        ["instance_id", "seq"],
        unique=False,
    )
    op.create_table(
        "job_definitions",
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("queue", sa.String(length=64), nullable=False),
        sa.Column(
            "options",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("max_concurrency", sa.Integer(), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column(
            "args_schema",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=200), nullable=True),
        sa.CheckConstraint(
            "max_concurrency >= 1", name=op.f("ck_job_definitions_max_concurrency_positive")
        ),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_job_definitions")),
    )
    op.create_table(
        "scheduler_leases",
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("shard", name=op.f("pk_scheduler_leases")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column(
            "queues",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "jobs",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_table(
        "job_instances",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("job_key", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("queue", sa.String(length=64), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column(
            "args",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("scheduled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("run_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("retries_used", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "unexpected_retries_used", sa.Integer(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("claim_token", sa.BigInteger(), nullable=True),
        sa.Column("worker_id", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "cancel_requested", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("pinned_worker", sa.String(length=200), nullable=True),
        sa.Column("retry_of", sa.Uuid(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("progress", sa.Float(), nullable=True),
        sa.Column("progress_message", sa.Text(), nullable=True),
        sa.Column(
            "checkpoint",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "result",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "error",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "source IN ('cron', 'trigger', 'retry')", name=op.f("ck_job_instances_source_valid")
        ),
        sa.CheckConstraint(
            f"state IN ({STATES})",
            name=op.f("ck_job_instances_state_valid"),
        ),
        sa.ForeignKeyConstraint(
            ["job_key"],
            ["job_definitions.key"],
            name=op.f("fk_job_instances_job_key_job_definitions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_instances")),
    )
    op.create_index(
        "ix_job_instances_due",
        "job_instances",
        ["run_at"],
        unique=False,
        postgresql_where=sa.text("state = 'scheduled'"),
        sqlite_where=sa.text("state = 'scheduled'"),
    )
    op.create_index("ix_job_instances_job_key_id", "job_instances", ["job_key", "id"], unique=False)
    op.create_index(
        "ix_job_instances_job_key_state_id",
        "job_instances",
        ["job_key", "state", "id"],
        unique=False,
    )
    op.create_index(
        "ix_job_instances_lease",
        "job_instances",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("state = 'processing'"),
        sqlite_where=sa.text("state = 'processing'"),
    )
    op.create_index("ix_job_instances_state_id", "job_instances", ["state", "id"], unique=False)
    op.create_index(
        "ix_job_instances_unpublished",
        "job_instances",
        ["job_key", "published_at"],
        unique=False,
        postgresql_where=sa.text("state = 'enqueued'"),
        sqlite_where=sa.text("state = 'enqueued'"),
    )
    op.create_index(
        "ix_job_instances_worker_id",
        "job_instances",
        ["worker_id"],
        unique=False,
        postgresql_where=sa.text("worker_id IS NOT NULL"),
    )
    op.create_index(
        "uq_job_instances_cron_occurrence",
        "job_instances",
        ["job_key", "scheduled_at"],
        unique=True,
        postgresql_where=sa.text("source = 'cron'"),
        sqlite_where=sa.text("source = 'cron'"),
    )
    op.create_index(
        "uq_job_instances_idempotency",
        "job_instances",
        ["job_key", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        sqlite_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_table(
        "job_slots",
        sa.Column("job_key", sa.String(length=200), nullable=False),
        sa.Column("used", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("used >= 0", name=op.f("ck_job_slots_used_not_negative")),
        sa.ForeignKeyConstraint(
            ["job_key"],
            ["job_definitions.key"],
            name=op.f("fk_job_slots_job_key_job_definitions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_key", name=op.f("pk_job_slots")),
    )


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"

    op.drop_table("job_slots")
    op.drop_index(
        "uq_job_instances_idempotency",
        table_name="job_instances",
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        sqlite_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_index(
        "uq_job_instances_cron_occurrence",
        table_name="job_instances",
        postgresql_where=sa.text("source = 'cron'"),
        sqlite_where=sa.text("source = 'cron'"),
    )
    op.drop_index(
        "ix_job_instances_worker_id",
        table_name="job_instances",
        postgresql_where=sa.text("worker_id IS NOT NULL"),
    )
    op.drop_index(
        "ix_job_instances_unpublished",
        table_name="job_instances",
        postgresql_where=sa.text("state = 'enqueued'"),
        sqlite_where=sa.text("state = 'enqueued'"),
    )
    op.drop_index("ix_job_instances_state_id", table_name="job_instances")
    op.drop_index(
        "ix_job_instances_lease",
        table_name="job_instances",
        postgresql_where=sa.text("state = 'processing'"),
        sqlite_where=sa.text("state = 'processing'"),
    )
    op.drop_index("ix_job_instances_job_key_state_id", table_name="job_instances")
    op.drop_index("ix_job_instances_job_key_id", table_name="job_instances")
    op.drop_index(
        "ix_job_instances_due",
        table_name="job_instances",
        postgresql_where=sa.text("state = 'scheduled'"),
        sqlite_where=sa.text("state = 'scheduled'"),
    )
    op.drop_table("job_instances")
    op.drop_table("workers")
    op.drop_table("scheduler_leases")
    op.drop_table("job_definitions")
    op.drop_index("ix_instance_transitions_instance_id_seq", table_name="instance_transitions")
    op.drop_index("ix_instance_transitions_at", table_name="instance_transitions")
    op.drop_table("instance_transitions")
    op.drop_table("counters")
    if postgres:
        op.execute(sa.schema.DropSequence(sa.Sequence("claim_token_seq")))
