"""The fault-injection harness, short form: 22 s of load and overlapping faults (every kind at
least once) on servers of its own, then zero violations. And the checker itself: each
invariant it checks is broken on purpose, directly in a database, and must be reported."""

from __future__ import annotations

import json
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
from tests.chaos.logscan import scan
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
    assert "one_at_a_time: 2 ran at once (runaways included), limit 1" in named(
        "max_concurrency_exceeded"
    )
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
    await define(pg_store, "slow", max_concurrency=5)
    a = await _plant_steps(
        pg_store,
        "slow",
        [
            (None, "enqueued", None, 0.0, None),
            ("enqueued", "processing", 1, 0.1, None),
            ("processing", "enqueued", 1, 2.5, "lease expired"),
            ("enqueued", "processing", 2, 2.6, None),
            ("processing", "succeeded", 2, 4.0, None),
        ],
    )
    runs = [
        Run(a, 1, "w1", 0, 2, "slow"),
        Run(a, 2, "w2", 1, 3, "slow"),  # a lost lease whose copy ran on: reported
        Run("b", 1, "w3", 0, 2),
        Run("b", 2, "w2", 1, 3),  # w3 was frozen meanwhile: not a fencing failure
        Run("c", 1, "w1", 0, None),  # its process died
        Run("c", 2, "w2", 0.5, 1),
        Run("d", 1, "w1", 0, 1.1),  # noted a moment late: within the tolerance
        Run("d", 2, "w2", 1, 2),
    ]
    found = await check(pg_store, {}, NOW, runs=runs, frozen=[("w3", 1.5, 1.8)])
    # With the job, both runs and every step the store recorded, with its time and actor.
    t0 = T0.timestamp()
    steps = ", ".join(
        f"{step} {t0 + after:.3f} w1"
        for step, after in (
            ("[*]>enqueued", 0.0),
            ("enqueued>processing#1", 0.1),
            ("processing>enqueued#1", 2.5),
            ("enqueued>processing#2", 2.6),
            ("processing>succeeded#2", 4.0),
        )
    )
    assert found.violations == {
        "two_copies_at_once": [
            f"{a}: attempt 1 on w1 and attempt 2 on w2 overlapped 1.00 s (slow; runs w1 #1 "
            f"0.000 to 2.000 and w2 #2 1.000 to 3.000; steps {steps})"
        ]
    }


async def _plant_steps(
    store: SqlStore, job: str, steps: list[tuple[str | None, str, int | None, float, str | None]]
) -> str:
    """An instance whose history is ``steps``: (from, to, claim token, seconds after T0,
    reason); each step by worker ``w1``."""
    instance_id = uuid.uuid4()
    values = {
        "id": instance_id,
        "job_key": job,
        "state": steps[-1][1],
        "source": "trigger",
        "queue": "default",
        "priority": 5,
        "created_at": T0,
    }
    async with store.engine.begin() as conn:
        await conn.execute(insert(job_instances).values(**values))
        for from_state, to_state, token, after_s, reason in steps:
            await conn.execute(
                insert(instance_transitions).values(
                    instance_id=instance_id,
                    from_state=from_state,
                    to_state=to_state,
                    at=T0 + timedelta(seconds=after_s),
                    actor="w1",
                    reason=reason,
                    claim_token=token,
                )
            )
    return str(instance_id)


async def test_a_runaway_holds_its_slot_in_the_concurrency_replay(pg_store: SqlStore) -> None:
    """A sync job recorded Failed on its timeout at +1 s whose code ran on until +3 s: an
    attempt of the same job (limit 1) claimed at +2 s ran beside it; one claimed at +4 s
    did not."""
    await define(pg_store, "alone", max_concurrency=1)
    await define(pg_store, "alone_later", max_concurrency=1)
    runs = []
    for job, next_claim_s in (("alone", 2.0), ("alone_later", 4.0)):
        timed_out = await _plant_steps(
            pg_store,
            job,
            [
                (None, "enqueued", None, 0, None),
                ("enqueued", "processing", 1, 0, None),
                ("processing", "failed", 1, 1, "timeout"),
                ("failed", "terminated", 1, 1, None),
            ],
        )
        await _plant_steps(
            pg_store,
            job,
            [
                (None, "enqueued", None, 0, None),
                ("enqueued", "processing", 2, next_claim_s, None),
                ("processing", "succeeded", 2, next_claim_s + 1, None),
            ],
        )
        start = T0.timestamp()
        runs.append(Run(timed_out, 1, "w1", start, start + 3, job))
    found = await check(pg_store, {}, NOW, runs=runs)
    assert list(found.violations) == ["max_concurrency_exceeded"], found.violations
    [detail] = found.violations["max_concurrency_exceeded"]
    assert detail.startswith("alone: 2 ran at once (runaways included), limit 1")
    assert found.runaways_held == 2
    # Without the runaway's run noted, its slot ends with its Failed step: no violation.
    assert (await check(pg_store, {}, NOW)).total == 0


def test_the_log_scan_tells_a_crash_from_a_handled_error() -> None:
    handled_retry = {
        "level": "WARNING",
        "logger": "jobplane_worker.worker",
        "message": "store unreachable; retrying",
        "action": "worker.store_retry",
        "exc": "Traceback (most recent call last):\n  ...\nOSError: refused",
    }
    handled_error = {"level": "ERROR", "message": "refused", "action": "worker.outcome_refused"}
    unhandled = {
        "level": "ERROR",
        "logger": "asyncio",
        "message": "Task exception was never retrieved",
        "exc": "Traceback (most recent call last):\nRuntimeError: boom",
    }
    text = "\n".join(
        [
            json.dumps(handled_retry),
            json.dumps(handled_error),
            json.dumps({"level": "INFO", "message": "Traceback (most recent call last) quoted"}),
            json.dumps(unhandled),
            "Exception in thread Thread-3:",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in run',
            "ValueError: bad",
            json.dumps({"level": "CRITICAL", "message": "gave up", "action": "worker.stop"}),
        ]
    )
    found = scan("w1", text)
    assert len(found.crashes) == 3, found.crashes
    assert "asyncio: Task exception was never retrieved" in found.crashes[0]
    assert "RuntimeError: boom" in found.crashes[0]
    assert "ValueError: bad" in found.crashes[1]
    assert "gave up" in found.crashes[2]
    assert found.handled == {"WARNING worker.store_retry": 1, "ERROR worker.outcome_refused": 1}


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_twenty_seconds_of_overlapping_faults_break_no_guarantee() -> None:
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    async with Harness() as harness:
        # Every kind once first: the 11th fault starts by 10 * 2 = 20 s, two seconds before
        # the faults stop. (`python -m tests.chaos` runs the long form: minutes of faults.)
        # As many requests as the 40 s form made at its 6 a second.
        report = await harness.run(22, seed=12, rate_per_s=10.0, fault_every_s=(1.5, 2.0))
        print(report.render())  # noqa: T201 (shown when the test fails)
        assert report.ok, report.render()
        assert set(KINDS) <= set(report.faults.kinds), report.faults.kinds
        assert report.acknowledged > 100 and report.drained_in_s is not None
        # Both ways in, and the guarantees' observers at work.
        assert {op.split(":")[0] for op in report.ops} == {"rest", "client"}, report.ops
        assert report.streams.samples > 0
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
