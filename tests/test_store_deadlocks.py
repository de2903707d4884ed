"""Lock order and conflict retries on real Postgres: statements that lock several rows lock
them in one global order (instances by id, slots by job key), so claims, outcomes, heartbeats
and ``published_at`` bookkeeping never deadlock; a transaction that still loses to a
concurrent one (a real deadlock, caused here by a second connection) is retried by the store.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from uuid import UUID

import httpx
import pytest
from sqlalchemy import text

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Envelope
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import NewInstance, Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.errors import BusUnavailableError
from jobplane.settings import SessionLimits
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from tests.apps.basic import app
from tests.store_helpers import define, slots_used
from tests.worker_helpers import running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(120)

JOBS = ["a", "b", "c", "d"]
PER_JOB = 100
RACERS = 8
ROUNDS = 6


def _conflict_retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if getattr(r, "action", None) == "store.conflict_retry"
    ]


async def _created_in_reverse_id_order(store: SqlStore) -> list[UUID]:
    """Instances inserted in descending id order, so their heap order (a sequential scan's
    lock order) is the reverse of the id order a claim locks them in."""
    new = [NewInstance(job_key=key) for key in JOBS for _ in range(PER_JOB)]
    new.sort(key=lambda n: n.id, reverse=True)
    made = await store.create_instances(new)
    assert all(i.state is S.ENQUEUED for i in made)
    return [i.id for i in made]


async def test_claims_outcomes_and_marks_racing_over_many_rows_do_not_deadlock(
    pg_store: SqlStore, pg_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobplane.store")
    for key in JOBS:
        await define(pg_store, key, max_concurrency=1000)
    ids = await _created_in_reverse_id_order(pg_store)
    stores = [open_store(pg_database_url, pool_size=2) for _ in range(2 * RACERS)]
    rng = random.Random(11)
    try:

        async def claimer(n: int, s: SqlStore) -> int:
            """Claims random overlapping batches, then records their outcomes in a shuffled
            order (the outcome statement takes instances and slots of every job)."""
            done = 0
            for _ in range(ROUNDS):
                batch = rng.sample(ids, 120)
                result = await s.claim(batch, f"w{n}", 30, JOBS)
                outcomes = [
                    Outcome(c.instance.id, c.instance.claim_token or 0, S.SUCCEEDED)
                    for c in result.claimed
                ]
                rng.shuffle(outcomes)
                done += len(await s.complete(outcomes))
            return done

        async def marker(s: SqlStore) -> None:
            """A publisher recording ``published_at`` for many rows in every order."""
            for _ in range(ROUNDS * 3):
                batch = rng.sample(ids, 200)
                rng.shuffle(batch)
                await s.mark_published(batch)

        results = await asyncio.gather(
            *(claimer(n, s) for n, s in enumerate(stores[:RACERS])),
            *(marker(s) for s in stores[RACERS:]),
        )
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    claimed_total = sum(r for r in results if isinstance(r, int))
    assert claimed_total > 0
    assert _conflict_retries(caplog) == [], "a statement deadlocked and had to be retried"
    counts = await pg_store.count_by_state()
    assert counts.get(S.SUCCEEDED, 0) == claimed_total
    assert counts.get(S.SUCCEEDED, 0) + counts.get(S.ENQUEUED, 0) == len(ids)
    assert all([await slots_used(pg_store, key) == 0 for key in JOBS])


async def _wait_until_blocked(store: SqlStore, pid_of_blocker: int) -> None:
    """Until some other backend waits on a lock held by ``pid_of_blocker``."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE :pid = ANY(pg_blocking_pids(pid)) AND datname = current_database()"
    )
    for _ in range(200):
        async with store.engine.connect() as conn:
            if (await conn.execute(query, {"pid": pid_of_blocker})).scalar_one():
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the store's statement never waited on the lock")


async def test_a_real_deadlock_is_retried_by_the_store(
    pg_store: SqlStore, pg_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A second connection takes the rows a heartbeat locks in the opposite order: Postgres
    breaks the deadlock by rolling the heartbeat back, and the store runs it again."""
    caplog.set_level(logging.WARNING, logger="jobplane.store")
    await define(pg_store, "job", max_concurrency=10)
    made = await pg_store.create_instances([NewInstance(job_key="job") for _ in range(2)])
    claimed = (await pg_store.claim([i.id for i in made], "w1", 30, ["job"])).claimed
    leases = sorted((c.instance.id, c.instance.claim_token or 0) for c in claimed)
    (first, _), (second, _) = leases
    other = open_store(pg_database_url, pool_size=1)
    try:
        async with other.engine.connect() as conn:
            # This session waits long before checking for deadlocks; the heartbeat's session
            # checks first (after 1 s), finds the cycle and is the one rolled back.
            await conn.execute(text("SET deadlock_timeout = '20s'"))
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            await conn.execute(
                text("SELECT 1 FROM job_instances WHERE id = :id FOR UPDATE"), {"id": second}
            )
            beat = asyncio.create_task(pg_store.heartbeat(leases, 30))
            await _wait_until_blocked(pg_store, pid)  # it holds `first`, waits for `second`
            await conn.execute(
                text("SELECT 1 FROM job_instances WHERE id = :id FOR UPDATE"), {"id": first}
            )
            await conn.commit()
            kept = await asyncio.wait_for(beat, 30)
    finally:
        await other.close()
    assert kept == {first: False, second: False}
    retries = _conflict_retries(caplog)
    assert retries and "deadlock" in retries[0]


async def test_a_statement_cancelled_by_its_timeout_is_retried_by_the_store(
    pg_store: SqlStore, pg_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A heartbeat whose statement outlives the session's ``statement_timeout`` (it waits on a
    row another session holds) is rolled back by the server: the store runs it again instead
    of handing the role a database error."""
    caplog.set_level(logging.WARNING, logger="jobplane.store")
    await define(pg_store, "job")
    made = await pg_store.create_instances([NewInstance(job_key="job")])
    claimed = (await pg_store.claim([made[0].id], "w1", 30, ["job"])).claimed
    leases = [(c.instance.id, c.instance.claim_token or 0) for c in claimed]
    limits = SessionLimits(
        lock_timeout_s=30, idle_in_transaction_timeout_s=30, statement_timeout_s=0.2, keepalive_s=5
    )
    timed = open_store(pg_database_url, pool_size=1, limits=limits)
    other = open_store(pg_database_url, pool_size=1)
    try:
        async with other.engine.connect() as conn:
            await conn.execute(
                text("SELECT 1 FROM job_instances WHERE id = :id FOR UPDATE"), {"id": made[0].id}
            )
            beat = asyncio.create_task(timed.heartbeat(leases, 30))

            # Hold the row until a try has timed out (polled: connecting takes longer than
            # the statement timeout on a loaded machine).
            async def timed_out() -> bool:
                return bool(_conflict_retries(caplog))

            await wait_for(timed_out, timeout_s=20, what="a try to time out")
            await conn.commit()
        kept = await asyncio.wait_for(beat, 30)
    finally:
        await timed.close()
        await other.close()
    assert kept == {made[0].id: False}
    retries = _conflict_retries(caplog)
    assert retries and "statement timeout" in retries[0]


async def _refuse_marks(store: SqlStore) -> None:
    """Every update of ``published_at`` fails in the database as a deadlock victim would."""
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION refuse_mark() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse_mark BEFORE UPDATE OF published_at ON job_instances "
                "FOR EACH ROW EXECUTE FUNCTION refuse_mark()"
            )
        )


async def test_the_api_never_answers_an_error_after_a_batch_trigger_committed(
    pg_store: SqlStore,
    redis_bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The batch is committed (marked by its insert), its send fails, and clearing its marks
    is refused by the database: the answer is still the instances."""
    await define(pg_store, "job", max_concurrency=10)
    await _refuse_marks(pg_store)

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(redis_bus, "publish", away)
    app = create_app(ApiSettings(auth_enabled=False), store=pg_store, bus=redis_bus)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            answer = await api.post(
                "/api/v1/instances/batch",
                json={"items": [{"job_key": "job"}, {"job_key": "job"}]},
            )
    assert answer.status_code == 201, answer.text
    made = [UUID(i["id"]) for i in answer.json()]
    assert {(await pg_store.get_instance(i)).state for i in made} == {S.ENQUEUED}
    assert any(getattr(r, "action", None) == "dispatch.unmark_failed" for r in caplog.records)


async def test_a_trigger_answers_once_committed_even_if_its_bookkeeping_fails(
    pg_store: SqlStore,
    redis_bus: Bus,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The instances are committed; the publication bookkeeping after them fails (a real
    database error, raised by a trigger in the database): the caller still gets its
    instances, never an error that would make it trigger again. A batch is marked by its
    insert; its send fails, and clearing the marks is refused (they stay: the sweep
    republishes marked, unclaimed instances after its threshold). With the bus back, the
    next batch is sent first (the last send failed) and its mark, written after, is refused."""
    await define(pg_store, "job", max_concurrency=10)
    await _refuse_marks(pg_store)
    dispatcher = Dispatcher(pg_store, redis_bus)
    send = redis_bus.publish

    async def away(envelopes: Sequence[tuple[str, Envelope]]) -> None:
        raise BusUnavailableError("redis is away")

    monkeypatch.setattr(redis_bus, "publish", away)
    unsent = await dispatcher.trigger_many([NewInstance(job_key="job") for _ in range(3)])
    monkeypatch.setattr(redis_bus, "publish", send)
    made = await dispatcher.trigger_many([NewInstance(job_key="job") for _ in range(3)])
    assert len(unsent) == len(made) == 3
    assert all(i.published_at is not None for i in unsent)  # as stored: the clear was refused
    for instances, marked in ((unsent, True), (made, False)):
        stored = [await pg_store.get_instance(i.id) for i in instances]
        assert all(i.state is S.ENQUEUED for i in stored)
        assert all((i.published_at is not None) is marked for i in stored)
    actions = {getattr(r, "action", None) for r in caplog.records}
    assert {"dispatch.unmark_failed", "dispatch.mark_published_failed"} <= actions
    consumer = redis_bus.consumer("w1", ["default"])
    delivered = await consumer.read(10, 500)
    assert {d.envelope.instance_id for d in delivered} == {i.id for i in made}


async def test_a_worker_outlives_claims_that_keep_losing_to_conflicts(
    pg_store: SqlStore, redis_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """Postgres rolls back the first claims (deadlock victims, raised for real by a trigger in
    the database): the store retries, then reports a short outage; the worker pauses instead
    of exiting, reclaims its entries and runs the instance."""
    caplog.set_level(logging.WARNING)
    async with pg_store.engine.begin() as conn:
        await conn.execute(text("CREATE SEQUENCE lost_claims"))  # not rolled back
        await conn.execute(
            text(
                "CREATE FUNCTION lose_claims() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.state = 'processing' AND nextval('lost_claims') <= 7 THEN "
                "RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END IF; "
                "RETURN NEW; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER lose_claims BEFORE UPDATE OF state ON job_instances "
                "FOR EACH ROW EXECUTE FUNCTION lose_claims()"
            )
        )
    async with running_worker(app, pg_store, redis_bus) as worker:
        instance = await Dispatcher(pg_store, redis_bus).trigger("echo", {"value": 1})
        [done] = await settled(pg_store, [instance.id], timeout_s=30)
        assert worker.intake.failure is None
    assert done.state is S.SUCCEEDED
    assert len(_conflict_retries(caplog)) >= 4
    paused = [r for r in caplog.records if getattr(r, "action", "") == "worker.unavailable"]
    assert paused and "transaction conflict" in paused[0].getMessage()
