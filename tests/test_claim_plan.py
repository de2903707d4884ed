"""The claim finds its candidates by primary key, whatever the planner's statistics say.

A claim names at most a batch of instance ids. Had the planner been free to read them through
an index on the job key or the state, it would have done so whenever the statistics did not
know the backlog (a new table, or a burst since the last ANALYZE), and every claim would have
read every Enqueued row of the job. Real Postgres; ``EXPLAIN`` only (nothing is executed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import text

from jobplane.domain.models import NewInstance
from jobplane.store.driver import DriverStatement
from jobplane.store.postgres_sql import CLAIM
from jobplane.store.sql import SqlStore
from tests.store_helpers import define


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


async def _candidate_scans(store: SqlStore, ids: list[Any]) -> list[dict[str, Any]]:
    """The plan nodes that read ``job_instances`` for the claim's candidates (CTE ``cand``)."""
    statement = DriverStatement(CLAIM, store.engine.dialect)
    params = {
        "ids": ids,
        "jobs": ["job"],
        "worker": "w1",
        "lease": 30.0,
        "limit_reason": "limit",
        "cancel_reason": "cancel",
    }
    async with store.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        args = [params[name] for name in statement.names]
        found = await driver.fetchval(f"EXPLAIN (FORMAT JSON) {statement.sql}", *args)
    # (SQLAlchemy's asyncpg dialect decodes json on its connections; plain asyncpg does not)
    [plan] = json.loads(found) if isinstance(found, str) else found
    [cand] = [n for n in _nodes(plan["Plan"]) if n.get("Subplan Name") == "CTE cand"]
    return [n for n in _nodes(cand) if n.get("Relation Name") == "job_instances"]


async def _backlog(store: SqlStore, count: int) -> list[Any]:
    made = await store.create_instances([NewInstance(job_key="job") for _ in range(count)])
    return [instance.id for instance in made]


def _by_primary_key(scans: list[dict[str, Any]]) -> bool:
    """No candidate scan reads the whole table, and the only index any of them reads is the
    primary key."""
    indexes = {n["Index Name"] for scan in scans for n in _nodes(scan) if "Index Name" in n}
    sequential = [scan for scan in scans if scan["Node Type"] == "Seq Scan"]
    return bool(scans) and not sequential and indexes == {"pk_job_instances"}


async def test_a_claim_on_a_table_never_analyzed_reads_by_primary_key(pg_store: SqlStore) -> None:
    await define(pg_store, "job")
    ids = await _backlog(pg_store, 3000)
    scans = await _candidate_scans(pg_store, ids[:5])
    assert _by_primary_key(scans), scans


async def test_a_claim_after_a_burst_the_statistics_missed_reads_by_primary_key(
    pg_store: SqlStore,
) -> None:
    # The statistics were taken when nothing was Enqueued (a history of finished instances);
    # then a backlog arrives. (Finished by a plain UPDATE: only the plan is looked at.)
    await define(pg_store, "job")
    await _backlog(pg_store, 3000)
    async with pg_store.engine.begin() as conn:
        await conn.execute(text("UPDATE job_instances SET state = 'succeeded'"))
    async with pg_store.engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("ANALYZE job_instances"))
    ids = await _backlog(pg_store, 3000)
    scans = await _candidate_scans(pg_store, ids[:5])
    assert _by_primary_key(scans), scans
