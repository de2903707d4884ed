"""Statements that end the Postgres sessions of a process taken to be gone: a scheduler
whose lease expired, a worker about to be marked dead.

The server's own limits end a session left idle in a transaction (a frozen or partitioned
client), but not one left *active*: a client frozen right after its driver prepared a statement
inside its transaction (asyncpg sends Parse, Describe and Flush, and the server then waits for
the Bind with the statement still active; a lock the parse waited for puts the freeze there),
or while a result was being sent to it. Neither ``statement_timeout`` nor the idle limit ends
it: its locks stay until the process resumes. The process that takes over ends such sessions
(``pg_terminate_backend``), found by their ``application_name`` (each role's sessions carry
its replica or worker id) and only among the sessions of the same database user.
"""

from __future__ import annotations

from sqlalchemy import text


def _sessions_named(name: str) -> str:
    """A join to the other sessions of this database and user whose ``application_name`` is
    the value of ``name`` (cut to 63 bytes, as the server cuts it)."""
    return f"""JOIN pg_stat_activity a
  ON a.datname = current_database()
 AND a.usename = current_user
 AND a.application_name = left({name}, 63)
 AND a.pid <> pg_backend_pid()"""


# The sessions of a replica whose lease has expired that still hold a lock on the lease table
# (a fenced write under way), ended (``pg_terminate_backend``) by the replica taking over. A
# session left idle in its transaction is ended by the server (the role's idle limit), but one
# left *active* is not: a leader frozen right after its driver prepared a statement inside the
# transaction (asyncpg's Parse, Describe and Flush: the server then waits for the Bind with the
# statement still active) or while a result was being sent to it, or one running a long
# statement. Such a session keeps its share lock on the lease row, so every takeover waits on
# it and times out, for as long as the process stays frozen. Only the sessions of the same
# database user are ended (``pg_terminate_backend`` allows no others), only while the lease is
# expired by the database's clock, and only another replica's: a writer that took its lock in
# time loses its transaction, never its term's fencing (the term changes with the takeover).
END_EXPIRED_HOLDER_SQL = f"""
SELECT a.pid, pg_terminate_backend(a.pid) AS ended
FROM scheduler_leases s
{_sessions_named("s.holder")}
WHERE s.shard = :shard
  AND s.holder <> :holder
  AND s.expires_at <= now()
  AND EXISTS (
      SELECT 1 FROM pg_locks l
      WHERE l.pid = a.pid AND l.granted AND l.relation = 'scheduler_leases'::regclass
  )
"""
END_EXPIRED_HOLDER = text(END_EXPIRED_HOLDER_SQL)

# The sessions of workers about to be marked dead (silent for the given time, by the database's
# clock) that are not idle, ended by the leader first: a worker frozen (SIGSTOP, a paused
# container) while a statement of its own was active - right after its driver's Parse, or while
# a large claim's rows were sent to it - keeps that statement's locks (its job's slot row, the
# claimed instances, its own worker row) with no idle limit to end them, and every claim of the
# job and the dead-worker sweep itself would wait on them until the process resumed. A session
# idle in a transaction is left to the server's idle limit. Same database user only, as for
# the leader's lease (``END_EXPIRED_HOLDER_SQL``).
END_SILENT_WORKERS_SQL = f"""
SELECT a.pid, w.id AS worker_id, pg_terminate_backend(a.pid) AS ended
FROM workers w
{_sessions_named("w.id")}
WHERE a.state = 'active'
  AND w.stopped_at IS NULL
  AND w.heartbeat_at < now() - make_interval(secs => :silent_for_s)
"""
END_SILENT_WORKERS = text(END_SILENT_WORKERS_SQL)
