"""announce each instance made Scheduled to the leader

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

FUNCTION = "jobplane_notify_due"
TRIGGER = "job_instances_notify_due"


def upgrade() -> None:
    # The leader reads, at each sweep, the delayed instances due before the next one and wakes
    # for each. One made Scheduled after that read (a trigger with a short delay, a retry's
    # backoff, a held instance released) waited for the next sweep: up to its interval late.
    # Every such row now announces its run_at on the leader's notification channel, from
    # whatever statement wrote it (delivered on commit only, as the enqueue notifications).
    # The trigger's condition is evaluated per row written; the function runs only for rows
    # that meet it. Postgres only: SQLite has no notifications; its store makes the same
    # announcements in-process, with triggers local to its connections (jobplane.store.sqlite).
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('jobplane_enqueued', 'due:' || extract(epoch FROM NEW.run_at));
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        f"""
        CREATE TRIGGER {TRIGGER}
        AFTER INSERT OR UPDATE OF state, run_at ON job_instances
        FOR EACH ROW WHEN (NEW.state = 'scheduled' AND NEW.run_at IS NOT NULL)
        EXECUTE FUNCTION {FUNCTION}()
        """
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON job_instances")
    op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")
