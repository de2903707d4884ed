"""The fault-injection harness, short form: about a minute of load and overlapping faults (every
kind at least once) on servers of its own, then zero violations. And the checker itself: each
invariant it checks is broken on purpose, directly in a database, and must be reported."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert, text

from jobplane.store.sql import SqlStore
from jobplane.store.tables import instance_transitions, job_instances
from tests.chaos.checker import Findings, Run, check
from tests.chaos.faults import KINDS
from tests.chaos.harness import Harness
from tests.chaos.servers import missing_requirement
from tests.store_helpers import define

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)
Path = list[tuple[str | None, str, int | None]]  # from, to, claim token


async def _plant(store: SqlStore, job: str, path: Path, **row: Any) -> str:
    """An instance whose history is ``path`` (its state the last one), written directly."""
    instance_id = uuid.uuid4()
    values = {
        "id": instance_id,
        "job_key": job,
        "state": path[-1][1],
        "source": "trigger",
        "queue": "default",
        "priority": 5,
        "created_at": T0,
        **row,
    }
    async with store.engine.begin() as conn:
        await conn.execute(insert(job_instances).values(**values))
        for from_state, to_state, token in path:
            await conn.execute(
                insert(instance_transitions).values(
                    instance_id=instance_id,
                    from_state=from_state,
                    to_state=to_state,
                    at=T0,
                    actor="test",
                    claim_token=token,
                )
            )
    return str(instance_id)


RAN: Path = [
    (None, "enqueued", None),
    ("enqueued", "processing", 1),
    ("processing", "succeeded", 1),
]


async def test_a_clean_store_has_no_violation(pg_store: SqlStore) -> None:
    await define(pg_store, "fast")
    made = await _plant(pg_store, "fast", RAN)
    found = await check(pg_store, {made: "fast"}, NOW)
    assert found.total == 0, found.violations
    assert found.states == {"succeeded": 1}


async def test_the_checker_reports_each_planted_violation(pg_store: SqlStore) -> None:
    await define(pg_store, "fast", max_concurrency=10)
    await define(pg_store, "one_at_a_time", max_concurrency=1)
    await define(pg_store, "tick_once", cron="* * * * * *")
    lost = str(uuid.uuid4())
    queued = await _plant(pg_store, "fast", [(None, "enqueued", None)])
    revived = await _plant(pg_store, "fast", [*RAN, ("succeeded", "processing", 1)])
    illegal = await _plant(
        pg_store, "fast", [(None, "enqueued", None), ("enqueued", "failed", None)]
    )
    zombie = await _plant(
        pg_store,
        "fast",
        [(None, "enqueued", None), ("enqueued", "processing", 7), ("processing", "succeeded", 6)],
    )
    # Two attempts of a job limited to one, running at once.
    for _ in range(2):
        await _plant(
            pg_store, "one_at_a_time", [(None, "enqueued", None), ("enqueued", "processing", 2)]
        )
    for second in (0, 1, 3):  # the tick at +2 s is missing
        await _plant(
            pg_store, "tick_once", RAN, source="cron", scheduled_at=T0 + timedelta(seconds=second)
        )
    await _plant(pg_store, "fast", RAN, retries_used=1)  # the job has no retries
    # The constraints that make these impossible are dropped, to see the checker notice them.
    async with pg_store.engine.begin() as conn:
        await conn.execute(text("DROP INDEX uq_job_instances_cron_occurrence"))
        await conn.execute(text("DROP INDEX uq_job_instances_idempotency"))
        await conn.execute(text("DROP INDEX uq_job_instances_idempotency_key"))
    await _plant(pg_store, "tick_once", RAN, source="cron", scheduled_at=T0)
    for _ in range(2):
        await _plant(pg_store, "fast", RAN, idempotency_key="same")

    found = await check(pg_store, {lost: "fast", queued: "fast"}, NOW)

    def named(invariant: str) -> str:
        return "\n".join(found.violations[invariant])

    assert lost in named("lost_acknowledged_trigger")
    assert queued in named("not_terminal_after_quiet_period")
    assert revived in named("transition_out_of_terminal")
    assert illegal in named("illegal_transition")
    assert zombie in named("stale_claim_write")
    assert "one_at_a_time: 2 ran at once, limit 1" in named("max_concurrency_exceeded")
    assert "tick_once: nothing between" in named("cron_tick_missing")
    assert "tick_once at 2026-01-01T00:00:00+00:00: 2 instances" in named("cron_tick_twice")
    assert "retries 1/0" in named("attempts_over_limit")
    assert "key 'same': 2 instances" in named("idempotency_key_reused")
    # The revived one, the Failed one and the two still Processing are unfinished too.
    assert len(found.violations["not_terminal_after_quiet_period"]) == 5
    assert found.total == 14, found.violations


async def test_the_checker_reports_two_copies_of_an_instance_running_at_once(
    pg_store: SqlStore,
) -> None:
    runs = [
        Run("a", 1, "w1", 0, 2),
        Run("a", 2, "w2", 1, 3),  # a lost lease whose copy ran on: reported
        Run("b", 1, "w3", 0, 2),
        Run("b", 2, "w2", 1, 3),  # w3 was frozen meanwhile: not a fencing failure
        Run("c", 1, "w1", 0, None),  # its process died
        Run("c", 2, "w2", 0.5, 1),
        Run("d", 1, "w1", 0, 1.1),  # noted a moment late: within the tolerance
        Run("d", 2, "w2", 1, 2),
    ]
    found = await check(pg_store, {}, NOW, runs=runs, frozen=[("w3", 1.5, 1.8)])
    assert found.violations == {
        "two_copies_at_once": ["a: attempt 1 on w1 and attempt 2 on w2 overlapped 1.00 s"]
    }


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_minute_of_overlapping_faults_breaks_no_guarantee() -> None:
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    async with Harness() as harness:
        report = await harness.run(60, seed=12, fault_every_s=(3.0, 5.0))
        print(report.render())  # noqa: T201 (shown when the test fails)
        assert report.ok, report.render()
        assert set(KINDS) <= set(report.faults.kinds), report.faults.kinds
        assert report.acknowledged > 100 and report.drained_in_s is not None
        # The checker sees what the harness's own database holds: a transition out of a
        # terminal state planted there is reported.
        done = next(i for i, s in await _states(harness.db) if s == "succeeded")
        async with harness.db.engine.begin() as conn:
            await conn.execute(
                insert(instance_transitions).values(
                    instance_id=done, from_state="succeeded", to_state="enqueued", actor="test"
                )
            )
        planted: Findings = await check(harness.db, {})
        assert [str(done) in v for v in planted.violations["transition_out_of_terminal"]] == [True]


async def _states(store: SqlStore) -> list[tuple[uuid.UUID, str]]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(text("SELECT id, state FROM job_instances ORDER BY id"))
        return [(r.id, r.state) for r in rows]
