"""SQLAlchemy Core tables. The Alembic migrations are the source of the schema; these mirror them
for queries (tests/test_migrations.py checks they agree)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Sequence,
    SmallInteger,
    String,
    Table,
    Text,
    Uuid,
    text,
)

from jobplane.domain.models import DefinitionChange
from jobplane.domain.states import InstanceState
from jobplane.store.types import Json, UtcDateTime

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

STATE_VALUES = ", ".join(f"'{s.value}'" for s in InstanceState)
CHANGE_VALUES = ", ".join(f"'{c.value}'" for c in DefinitionChange)

#: Fencing tokens for claims (Postgres). SQLite keeps its counter in the ``counters`` table.
claim_token_seq = Sequence("claim_token_seq", metadata=metadata)

job_definitions = Table(
    "job_definitions",
    metadata,
    Column("key", String(200), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("queue", String(64), nullable=False),
    Column("options", Json, nullable=False),
    Column("max_concurrency", Integer, nullable=False),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    Column("version", Integer, nullable=False, server_default=text("1")),
    Column("args_schema", Json, nullable=True),
    Column("created_at", UtcDateTime, nullable=False),
    Column("updated_at", UtcDateTime, nullable=False),
    Column("updated_by", String(200), nullable=True),
    # When cron, time zone or start_at last changed (migration 0013); null: never edited.
    Column("schedule_since", UtcDateTime, nullable=True),
    # The name of the App whose worker last registered the job (migration 0015); null: none
    # since the column exists.
    Column("app", String(200), nullable=True),
    CheckConstraint("max_concurrency >= 1", name="max_concurrency_positive"),
)

# Every save of a definition, in full: history is appended, never rewritten (a rollback is a
# new version whose options are an older one's).
job_definition_versions = Table(
    "job_definition_versions",
    metadata,
    Column(
        "job_key",
        String(200),
        ForeignKey("job_definitions.key", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("version", Integer, primary_key=True),
    Column("options", Json, nullable=False),
    Column("paused", Boolean, nullable=False),
    Column("action", String(16), nullable=False),
    Column("actor", String(200), nullable=False),
    Column("at", UtcDateTime, nullable=False),
    Column("rolled_back_to", Integer, nullable=True),
    CheckConstraint(f"action IN ({CHANGE_VALUES})", name="action_valid"),
)

# One counter row per job key: the concurrency slots in use. A claim takes slots in its own
# statement (``used + n <= max``, row-locked) and a terminal or release transition gives them back
# in its own statement, so the limit never depends on counting Processing rows.
job_slots = Table(
    "job_slots",
    metadata,
    Column(
        "job_key",
        String(200),
        ForeignKey("job_definitions.key", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("used", Integer, nullable=False, server_default=text("0")),
    CheckConstraint("used >= 0", name="used_not_negative"),
)

# A slot of ``job_slots`` still held by an attempt whose outcome is recorded (Failed on timeout)
# while its sync code keeps running in a thread that cannot be stopped: one row per such attempt,
# keyed by its instance and claim token. Its worker deletes it (and gives the slot back) once the
# thread returns; the dead-worker sweep does so if that worker goes away first.
runaway_slots = Table(
    "runaway_slots",
    metadata,
    Column("instance_id", Uuid, primary_key=True),
    Column("claim_token", BigInteger, primary_key=True),
    Column(
        "job_key",
        String(200),
        ForeignKey("job_definitions.key", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("worker_id", String(200), nullable=False),
    Column("held_since", UtcDateTime, nullable=False),
    Index("ix_runaway_slots_worker_id", "worker_id"),
)

job_instances = Table(
    "job_instances",
    metadata,
    Column("id", Uuid, primary_key=True),  # UUIDv7: time-ordered
    Column("job_key", String(200), ForeignKey("job_definitions.key"), nullable=False),
    Column("state", String(16), nullable=False),
    Column("source", String(16), nullable=False),
    Column("queue", String(64), nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("args", Json, nullable=True),
    Column("created_at", UtcDateTime, nullable=False),
    Column("scheduled_at", UtcDateTime, nullable=True),
    Column("run_at", UtcDateTime, nullable=True),
    Column("published_at", UtcDateTime, nullable=True),
    Column("started_at", UtcDateTime, nullable=True),
    Column("finished_at", UtcDateTime, nullable=True),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("retries_used", Integer, nullable=False, server_default=text("0")),
    Column("unexpected_retries_used", Integer, nullable=False, server_default=text("0")),
    Column("claim_token", BigInteger, nullable=True),
    Column("worker_id", String(200), nullable=True),
    Column("lease_expires_at", UtcDateTime, nullable=True),
    Column("cancel_requested", Boolean, nullable=False, server_default=text("false")),
    Column("pinned_worker", String(200), nullable=True),
    Column("retry_of", Uuid, nullable=True),
    Column("idempotency_key", String(200), nullable=True),
    # SHA-256 of the request that used ``idempotency_key`` (jobplane.idempotency).
    Column("idempotency_fingerprint", String(64), nullable=True),
    Column("progress", Float, nullable=True),
    Column("progress_message", Text, nullable=True),
    Column("checkpoint", Json, nullable=True),
    Column("result", Json, nullable=True),
    Column("error", Json, nullable=True),
    Column("reason", Text, nullable=True),
    CheckConstraint(f"state IN ({STATE_VALUES})", name="state_valid"),
    CheckConstraint("source IN ('cron', 'trigger', 'retry')", name="source_valid"),
    # Exactly one fire per cron tick: two schedulers that both believe they lead cannot both
    # insert the same occurrence. Manual triggers of a recurring job are not occurrences.
    Index(
        "uq_job_instances_cron_occurrence",
        "job_key",
        "scheduled_at",
        unique=True,
        postgresql_where=text("source = 'cron'"),
        sqlite_where=text("source = 'cron'"),
    ),
    # A replayed trigger with the same Idempotency-Key returns the first instance. One key
    # names one request, whatever the job: the index on the key alone covers every instance
    # created with a fingerprint (0006); the one on (job, key) still covers older instances.
    Index(
        "uq_job_instances_idempotency",
        "job_key",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
        sqlite_where=text("idempotency_key IS NOT NULL"),
    ),
    Index(
        "uq_job_instances_idempotency_key",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_fingerprint IS NOT NULL"),
        sqlite_where=text("idempotency_fingerprint IS NOT NULL"),
    ),
    # Keyset listings: by job, by state, by both; newest first on the time-ordered id.
    Index("ix_job_instances_job_key_id", "job_key", "id"),
    Index("ix_job_instances_state_id", "state", "id"),
    Index("ix_job_instances_job_key_state_id", "job_key", "state", "id"),
    Index(
        "ix_job_instances_worker_id_id",
        "worker_id",
        "id",
        postgresql_where=text("worker_id IS NOT NULL"),
    ),
    # The latest outcome of each job and its recent counts by state (the jobs list; the
    # state is carried so that Postgres counts from the index alone).
    Index(
        "ix_job_instances_job_key_finished_at",
        "job_key",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
        postgresql_include=["state"],
        sqlite_where=text("finished_at IS NOT NULL"),
    ),
    # Sweeps of the leader: due Scheduled instances, expired leases, stale publications.
    Index(
        "ix_job_instances_due",
        "run_at",
        postgresql_where=text("state = 'scheduled'"),
        sqlite_where=text("state = 'scheduled'"),
    ),
    Index(
        "ix_job_instances_lease",
        "lease_expires_at",
        postgresql_where=text("state = 'processing'"),
        sqlite_where=text("state = 'processing'"),
    ),
    Index(
        "ix_job_instances_unpublished",
        "job_key",
        "published_at",
        "id",  # (ties: a batch is published at one time; the sweep pages by both)
        postgresql_where=text("state = 'enqueued'"),
        sqlite_where=text("state = 'enqueued'"),
    ),
    Index(
        "ix_job_instances_pinned_enqueued",
        "pinned_worker",
        postgresql_where=text("state = 'enqueued' AND pinned_worker IS NOT NULL"),
        sqlite_where=text("state = 'enqueued' AND pinned_worker IS NOT NULL"),
    ),
)

instance_transitions = Table(
    "instance_transitions",
    metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True),
    Column("instance_id", Uuid, nullable=False),
    Column("from_state", String(16), nullable=True),
    Column("to_state", String(16), nullable=False),
    # clock_timestamp(), not now(): now() is the transaction's start.
    Column("at", UtcDateTime, nullable=False),  # server default: the database clock
    Column("actor", String(200), nullable=False),
    Column("reason", Text, nullable=True),
    Column("claim_token", BigInteger, nullable=True),
    Index("ix_instance_transitions_instance_id_seq", "instance_id", "seq"),
    Index("ix_instance_transitions_at", "at"),
)

workers = Table(
    "workers",
    metadata,
    Column("id", String(200), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("queues", Json, nullable=False),
    Column("jobs", Json, nullable=False),
    Column("capacity", Integer, nullable=False),
    Column("version", String(64), nullable=False),
    Column("started_at", UtcDateTime, nullable=False),
    Column("heartbeat_at", UtcDateTime, nullable=False),
    Column("stopped_at", UtcDateTime, nullable=True),
    # The live workers (the metrics' count, the sweeps): every process start adds a row that
    # stays after it stops, so the live ones are read from this index, not the table.
    Index(
        "ix_workers_live",
        "id",
        postgresql_where=text("stopped_at IS NULL"),
        sqlite_where=text("stopped_at IS NULL"),
    ),
)

scheduler_leases = Table(
    "scheduler_leases",
    metadata,
    Column("shard", Integer, primary_key=True),
    Column("holder", String(200), nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("acquired_at", UtcDateTime, nullable=False),
    Column("expires_at", UtcDateTime, nullable=False),
)

# Every scheduler replica's last campaign (migration 0016): one row per replica, written each
# time it campaigns, so standbys can be listed. Rows of replicas silent for an hour are pruned
# by the next campaign; a replica that stops cleanly deletes its own.
scheduler_replicas = Table(
    "scheduler_replicas",
    metadata,
    Column("shard", Integer, primary_key=True),
    Column("holder", String(200), primary_key=True),
    Column("started_at", UtcDateTime, nullable=False),
    Column("seen_at", UtcDateTime, nullable=False),
)

# Counters for backends without sequences (SQLite): name → last value handed out.
counters = Table(
    "counters",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("name", String(200), nullable=False),
    Column("role", String(16), nullable=False),
    # SHA-256 of the secret: the secret itself is shown once and never stored.
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("hint", String(16), nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("created_by", String(200), nullable=False),
    Column("revoked_at", UtcDateTime, nullable=True),
    # The revoking token's name (or "cli"); empty for tokens revoked before migration 0020.
    Column("revoked_by", String(200), nullable=True),
    Column("expires_at", UtcDateTime, nullable=True),
    # Written at most about once a minute per token (see TokenStore.authenticate).
    Column("last_used_at", UtcDateTime, nullable=True),
    CheckConstraint("role IN ('viewer', 'operator', 'admin')", name="role_valid"),
)

# How many instances each job has in each state, kept by database triggers on job_instances
# (migration 0017) in the same transaction as every insert, state change and delete. Postgres
# spreads each (job, state) over shards (one per backend, modulo 16; a cron tick written ahead
# writes shard 16, migration 0024) so that concurrent writers do not queue on one row; a count
# is the sum of its shards.
instance_counts = Table(
    "instance_counts",
    metadata,
    Column("job_key", String(200), primary_key=True),
    Column("state", String(16), primary_key=True),
    Column("shard", SmallInteger, primary_key=True),
    Column("n", BigInteger, nullable=False),
)
