"""The plans of the statements that read the instance table on the hot paths and in the
leader's sweeps, whatever the planner's statistics say.

A claim names a batch of instance ids, a batch of outcomes the attempts it ends: they find them
by primary key. Had the planner been free to read them through an index on the state (or on a
job's Enqueued rows), it would have done so whenever the statistics did not know how many rows
were in that state (a new table, or a burst since the last ANALYZE), and every such statement
would have read every row in that state. The leader's sweeps read a range of an index in its
order, or a partial index of the few rows they look for, not the backlog. Real Postgres;
``EXPLAIN`` only (nothing is executed), but for the marks' test, which runs them and reads how
each run was planned."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select, text

from jobplane.domain.models import NewInstance
from jobplane.domain.states import InstanceState
from jobplane.settings import SessionLimits
from jobplane.store.base import unindexed_state
from jobplane.store.driver import DriverStatement
from jobplane.store.factory import open_store
from jobplane.store.postgres_sql import CLAIM, COMPLETE, RENEW, UNPUBLISHED
from jobplane.store.publication import FIRST_PUBLISHED, enqueued_page
from jobplane.store.sql import SqlStore
from jobplane.store.sweeps import orphaned_pins
from jobplane.store.tables import job_instances
from tests.store_helpers import define


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


async def _explain(store: SqlStore, sql: str, args: list[Any]) -> dict[str, Any]:
    async with store.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        found = await driver.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *args)
    # (SQLAlchemy's asyncpg dialect decodes json on its connections; plain asyncpg does not)
    [plan] = json.loads(found) if isinstance(found, str) else found
    top: dict[str, Any] = plan["Plan"]
    return top


async def _explain_statement(
    store: SqlStore, statement: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """The plan of one of the store's ``text()`` statements, compiled as the store runs it on
    the driver, for ``params`` by name."""
    compiled = DriverStatement(statement, store.engine.dialect)
    return await _explain(store, compiled.sql, [params[name] for name in compiled.names])


def _scans(node: dict[str, Any], cte: str | None = None) -> list[dict[str, Any]]:
    """The plan nodes that read ``job_instances`` (under the CTE ``cte`` if given)."""
    if cte is not None:
        [node] = [n for n in _nodes(node) if n.get("Subplan Name") == f"CTE {cte}"]
    return [n for n in _nodes(node) if n.get("Relation Name") == "job_instances"]


async def _claim_scans(store: SqlStore, ids: list[Any]) -> list[dict[str, Any]]:
    """The plan nodes that read ``job_instances`` for the claim's candidates (CTE ``cand``)."""
    params = {
        "ids": ids,
        "jobs": ["job"],
        "worker": "w1",
        "lease": 30.0,
        "limit_reason": "limit",
        "cancel_reason": "cancel",
    }
    plan = await _explain_statement(store, CLAIM, params)
    return _scans(plan, "cand")


async def _backlog(store: SqlStore, count: int) -> list[Any]:
    made = await store.create_instances([NewInstance(job_key="job") for _ in range(count)])
    return [instance.id for instance in made]


async def _attempts_after_a_burst(store: SqlStore) -> list[Any]:
    """3,000 running attempts, claimed from a burst behind an analyzed finished history."""
    await _finished_history(store)
    ids = await _backlog(store, 3000)
    claimed = []
    for start in range(0, len(ids), 500):
        claimed += (await store.claim(ids[start : start + 500], "w1", 30, ["job"])).claimed
    return [claim.instance for claim in claimed]


def _by_primary_key(scans: list[dict[str, Any]]) -> bool:
    """No candidate scan reads the whole table, and the only index any of them reads is the
    primary key."""
    indexes = {n["Index Name"] for scan in scans for n in _nodes(scan) if "Index Name" in n}
    sequential = [scan for scan in scans if scan["Node Type"] == "Seq Scan"]
    return bool(scans) and not sequential and indexes == {"pk_job_instances"}


async def test_a_claim_on_a_table_never_analyzed_reads_by_primary_key(pg_store: SqlStore) -> None:
    await define(pg_store, "job")
    ids = await _backlog(pg_store, 3000)
    scans = await _claim_scans(pg_store, ids[:5])
    assert _by_primary_key(scans), scans


async def test_a_claim_after_a_burst_the_statistics_missed_reads_by_primary_key(
    pg_store: SqlStore,
) -> None:
    await _finished_history(pg_store)
    ids = await _backlog(pg_store, 3000)
    scans = await _claim_scans(pg_store, ids[:5])
    assert _by_primary_key(scans), scans


async def test_outcomes_recorded_after_a_burst_find_their_attempts_by_primary_key(
    pg_store: SqlStore,
) -> None:
    attempts = (await _attempts_after_a_burst(pg_store))[:5]
    params = {
        "ids": [a.id for a in attempts],
        "tokens": [a.claim_token for a in attempts],
        "states": ["succeeded"] * 5,
        "results": [None] * 5,
        "errors": [None] * 5,
        "reasons": [None] * 5,
        "holds": [False] * 5,
        "cancel_reason": "cancel",
    }
    plan = await _explain_statement(pg_store, COMPLETE, params)
    assert _by_primary_key(_scans(plan, "locked")), _scans(plan, "locked")
    assert _by_primary_key(_scans(plan, "done")), _scans(plan, "done")


async def test_lease_renewals_after_a_burst_find_their_attempts_by_primary_key(
    pg_store: SqlStore,
) -> None:
    attempts = (await _attempts_after_a_burst(pg_store))[:512]
    params = {
        "ids": [a.id for a in attempts],
        "tokens": [a.claim_token for a in attempts],
        "lease": 30.0,
    }
    plan = await _explain_statement(pg_store, RENEW, params)
    locked, renewed = _scans(plan, "locked"), _scans(plan)
    assert _by_primary_key(locked), locked
    assert _by_primary_key(renewed), renewed


async def test_a_statement_built_with_the_rule_reads_by_primary_key(pg_store: SqlStore) -> None:
    # The statements the store builds with SQLAlchemy (moves, heartbeats, publication marks)
    # name their instances with ``unindexed_state``.
    await _finished_history(pg_store)
    ids = await _backlog(pg_store, 3000)
    query = select(job_instances.c.id).where(
        job_instances.c.id.in_(ids[:5]), unindexed_state(job_instances.c, InstanceState.ENQUEUED)
    )
    sql = str(query.compile(pg_store.engine, compile_kwargs={"literal_binds": True}))
    assert _by_primary_key(_scans(await _explain(pg_store, sql, [])))


async def test_a_page_of_the_enqueued_after_a_burst_reads_only_its_rows(
    pg_store: SqlStore,
) -> None:
    # The leader republishes every Enqueued instance, a page at a time, after the bus lost
    # everything: each page is a range of ix_job_instances_state_id, read in its order. (With
    # fewer finished instances than these, ``state = 'enqueued' AND id > :after`` happened to
    # be planned so too.)
    await _finished_history(pg_store, 30_000)
    ids = await _backlog(pg_store, 3000)
    for after in (None, sorted(ids)[1000]):
        query = enqueued_page(after, 1000)
        sql = str(query.compile(pg_store.engine, compile_kwargs={"literal_binds": True}))
        plan = await _explain(pg_store, sql, [])
        scans = _scans(plan)
        indexes = {n.get("Index Name") for n in scans}
        assert indexes == {"ix_job_instances_state_id"}, scans
        assert not [n for n in _nodes(plan) if n["Node Type"] == "Sort"], plan


async def test_the_republish_sweep_reads_the_stale_rows_of_each_job_in_index_order(
    pg_store: SqlStore,
) -> None:
    # Every second the leader asks for the Enqueued instances whose message may be lost: read
    # per job from ix_job_instances_unpublished, in its order, from where the last page ended,
    # up to the limit, never the whole backlog.
    await _finished_history(pg_store)
    ids = await _backlog(pg_store, 3000)
    await pg_store.mark_published(ids)
    middle = await pg_store.get_instance(ids[1500])
    assert middle.published_at is not None
    for after_at, after_id in (FIRST_PUBLISHED, (middle.published_at, middle.id)):
        # The first page, and one that starts in the middle: from there in the index.
        params = {
            "older": 30.0,
            "grace": 0.5,
            "limit": 1000,
            "after_at": after_at,
            "after_id": after_id,
        }
        plan = await _explain_statement(pg_store, UNPUBLISHED, params)
        scans = _scans(plan)
        assert {n.get("Index Name") for n in scans} == {"ix_job_instances_unpublished"}, scans
        # The page starts in the index (published_at, id), not by filtering what precedes it.
        assert any("ROW(published_at, id) >" in n.get("Index Cond", "") for n in scans), scans
        # One sort: the merge of the jobs' rows; each job's are read in the index's order.
        assert len([n for n in _nodes(plan) if n["Node Type"] == "Sort"]) == 1, plan


async def test_the_orphaned_pins_sweep_reads_only_the_pinned_enqueued(pg_store: SqlStore) -> None:
    # With statistics that know the backlog, the sweep reads the partial index of the pinned
    # Enqueued instances, not the backlog.
    await _finished_history(pg_store)
    await _backlog(pg_store, 3000)
    await pg_store.create_instances([NewInstance(job_key="job", pinned_worker="gone")])
    async with pg_store.engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("ANALYZE job_instances"))
    sql = str(orphaned_pins().compile(pg_store.engine, compile_kwargs={"literal_binds": True}))
    scans = _scans(await _explain(pg_store, sql, []))
    assert {n.get("Index Name") for n in scans} == {"ix_job_instances_pinned_enqueued"}, scans


async def test_no_session_compiles_its_statements(pg_database_url: str) -> None:
    # JIT compilation: the planner's cost of the Jobs page's summaries over a busy day passes
    # Postgres's threshold, and compiling took most of the statement. Roles' sessions (with
    # their limits) and the others alike run without it.
    limits = SessionLimits(
        lock_timeout_s=5, idle_in_transaction_timeout_s=5, statement_timeout_s=5, keepalive_s=5
    )
    for given in (limits, None):
        store = open_store(pg_database_url, pool_size=1, limits=given)
        try:
            async with store.engine.connect() as conn:
                assert (await conn.execute(text("SHOW jit"))).scalar() == "off"
        finally:
            await store.close()


async def _finished_history(store: SqlStore, count: int = 3000) -> None:
    """``count`` finished instances, analyzed: the statistics then say that Enqueued and
    Processing rows are rare. (Finished by a plain UPDATE: only plans are looked at.)"""
    await define(store, "job")
    await _backlog(store, count)
    async with store.engine.begin() as conn:
        await conn.execute(text("UPDATE job_instances SET state = 'succeeded'"))
    async with store.engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("ANALYZE job_instances"))


async def test_marks_are_planned_for_their_own_ids_never_from_a_cached_generic_plan(
    pg_database_url: str,
) -> None:
    # The mark of a batch trigger names its ids as parameters of a statement prepared once per
    # list length. After five runs Postgres may keep a generic plan made for the table's size
    # at that moment; on a table grown since (a burst into a new or quiet table) it read every
    # row and compared each with every id: 0.4 s a mark of 1,000 at 100,000 rows (planned
    # freely, the last six of these 24 marks ran from a generic plan). Executed on one pooled
    # connection, whose prepared statements say how each run was planned.
    store = open_store(pg_database_url, pool_size=1)
    try:
        await define(store, "job")
        for burst in range(24):
            made = await _backlog(store, 1000)
            if burst == 0:  # analyzed small: what a generic plan would be made with
                async with store.engine.connect() as conn:
                    await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await conn.execute(text("ANALYZE job_instances"))
            await store.mark_published(made)
        async with store.engine.connect() as conn:
            plans = (
                await conn.execute(
                    text(
                        "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                        "WHERE statement LIKE 'UPDATE job_instances SET published_at%'"
                    )
                )
            ).all()
        assert [(p.generic_plans, p.custom_plans) for p in plans] == [(0, 24)]
    finally:
        await store.close()
