"""The leader's store operations, on Postgres and SQLite, fenced by the leader's term."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from uuid import UUID

import pytest

from jobplane.domain.models import (
    InstanceFilter,
    InstanceSource,
    LeaderLease,
    NewInstance,
    Outcome,
    WorkerInfo,
)
from jobplane.domain.reasons import EndReason
from jobplane.domain.states import InstanceState as S
from jobplane.errors import DefinitionsChangedError, JobNotFoundError
from jobplane.store.base import NotLeaderError
from jobplane.store.publication import NEVER_PUBLISHED_GRACE_S
from jobplane.store.sql import SqlStore
from tests.store_helpers import define, enqueue


async def _lead(store: SqlStore, holder: str = "s1", ttl: float = 30) -> LeaderLease:
    lease = await store.acquire_leadership(0, holder, ttl)
    assert lease is not None
    return lease


async def test_a_deposed_leader_writes_nothing(store: SqlStore) -> None:
    await define(store, "tick", cron="* * * * * *")
    old = await _lead(store, "s1", ttl=0.2)
    await asyncio.sleep(0.3)  # s1 paused past its lease (SIGSTOP, GC, partition)
    new = await _lead(store, "s2")
    assert new.term == old.term + 1
    tick = (await store.now()).replace(microsecond=0)
    occurrence = NewInstance(job_key="tick", source=InstanceSource.CRON, scheduled_at=tick)
    with pytest.raises(NotLeaderError):
        await store.fire(old, [occurrence])
    with pytest.raises(NotLeaderError):
        await store.promote_due(old)
    with pytest.raises(NotLeaderError):
        await store.release_expired(old)
    assert await store.count_by_state() == {}
    [fired] = await store.fire(new, [occurrence])
    [again] = await store.fire(new, [occurrence])  # one tick, one instance, whoever fires it
    assert fired.id == again.id
    assert await store.last_occurrences(["tick"]) == {"tick": tick}


async def test_a_deposed_leaders_other_sweep_writes_are_refused(store: SqlStore) -> None:
    """Marking workers dead, retention and ``published_at`` bookkeeping are leader writes
    too: fenced by the term, a deposed leader's sweep changes nothing."""
    await define(store, "job", max_concurrency=5)
    info = WorkerInfo(id="w1", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await store.register_worker(info)
    [done] = await enqueue(store)
    await store.request_cancel(done.id, "ops")
    [waiting] = await enqueue(store)
    old = await _lead(store, "s1", ttl=0.2)
    await asyncio.sleep(0.3)
    await _lead(store, "s2")
    later = await store.now() + timedelta(hours=1)
    with pytest.raises(NotLeaderError):
        await store.mark_dead_workers(0.1, fence=old)
    with pytest.raises(NotLeaderError):
        await store.delete_finished_before(later, fence=old)
    with pytest.raises(NotLeaderError):
        await store.mark_published([waiting.id], fence=old)
    [alive] = await store.list_workers()
    assert alive.id == "w1" and alive.stopped_at is None
    assert (await store.get_instance(done.id)).state is S.CANCELLED
    assert (await store.get_instance(waiting.id)).published_at is None


async def test_promote_due_enqueues_only_what_is_due(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=5)
    lease = await _lead(store)
    now = await store.now()
    [soon] = await enqueue(store, run_at=now + timedelta(milliseconds=300))
    [later] = await enqueue(store, run_at=now + timedelta(hours=1))
    [held] = await enqueue(store, held=True)
    assert await store.scheduled_due_within(1.0) == [soon.run_at]
    assert await store.promote_due(lease) == []
    await asyncio.sleep(0.35)
    [promoted] = await store.promote_due(lease)
    assert promoted.id == soon.id and promoted.state is S.ENQUEUED
    assert (await store.get_instance(later.id)).state is S.SCHEDULED
    assert (await store.get_instance(held.id)).state is S.SCHEDULED
    steps = [(t.from_state, t.to_state) for t in await store.transitions(soon.id)]
    assert steps == [(None, S.SCHEDULED), (S.SCHEDULED, S.ENQUEUED)]


async def test_lease_ends_within_a_horizon_are_listed_once_each(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=10)
    first, second, third, later = await enqueue(store, n=4)
    two = (await store.claim([first.id, second.id], "w1", 0.5, ["job"])).claimed
    [alone] = (await store.claim([third.id], "w2", 0.8, ["job"])).claimed
    await store.claim([later.id], "w3", 60, ["job"])  # ends beyond the horizon
    running = [await store.get_instance(i.id) for i in (first, second, third)]
    end_of = {i.id: i.lease_expires_at for i in running}
    # One claim of two: both leases end at the claim's time plus the lease, listed once.
    assert len(two) == 2 and end_of[first.id] == end_of[second.id]
    assert await store.leases_ending_within(1.0) == [end_of[first.id], end_of[third.id]]
    await store.complete([Outcome(third.id, alone.token, S.SUCCEEDED)])  # no longer running
    assert await store.leases_ending_within(1.0) == [end_of[first.id]]


async def test_expired_leases_are_released_then_terminated(store: SqlStore) -> None:
    await define(store, "job", max_unexpected_retries=1)
    lease = await _lead(store)
    [inst] = await enqueue(store)
    [c1] = (await store.claim([inst.id], "w1", 0.1, ["job"])).claimed
    await asyncio.sleep(0.2)
    [released] = await store.release_expired(lease)
    assert released.state is S.ENQUEUED and released.unexpected_retries_used == 1
    assert released.retries_used == 0
    # The old attempt's late write is refused: its token no longer holds.
    assert await store.complete([Outcome(inst.id, c1.token, S.SUCCEEDED)]) == {}
    [c2] = (await store.claim([inst.id], "w2", 0.1, ["job"])).claimed  # the slot came back
    await asyncio.sleep(0.2)
    assert await store.release_expired(lease) == []  # exhausted: not released again
    done = await store.get_instance(inst.id)
    assert done.state is S.TERMINATED and done.reason == "max unexpected retries exhausted"
    assert await store.complete([Outcome(inst.id, c2.token, S.SUCCEEDED)]) == {}
    [again] = await enqueue(store)
    assert (await store.claim([again.id], "w3", 10, ["job"])).claimed  # slot free again


async def test_expired_lease_with_a_pending_cancel_ends_cancelled(store: SqlStore) -> None:
    await define(store, "job")
    lease = await _lead(store)
    [inst] = await enqueue(store)
    await store.claim([inst.id], "w1", 0.1, ["job"])
    await store.request_cancel(inst.id, "ops")
    await asyncio.sleep(0.2)
    assert await store.release_expired(lease) == []
    assert (await store.get_instance(inst.id)).state is S.CANCELLED


async def test_unpublished_finds_lost_messages_but_not_parked_full_jobs(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=1, on_limit="wait")
    a, b = await enqueue(store, n=2)
    await store.mark_published([a.id, b.id])
    await asyncio.sleep(0.2)
    stale = await store.unpublished(0.1)
    assert {i.id for i in stale} == {a.id, b.id}
    result = await store.claim([a.id, b.id], "w1", 10, ["job"])
    assert result.waiting == [b.id]
    await asyncio.sleep(0.2)
    assert await store.unpublished(0.1) == []  # b is parked and its job is full
    await store.complete([Outcome(a.id, result.claimed[0].token, S.SUCCEEDED)])
    assert [i.id for i in await store.unpublished(0.1)] == [b.id]
    assert [i.id for i in await store.all_enqueued(None)] == [b.id]


async def test_the_sweep_takes_the_never_published_then_the_oldest_publication(
    store: SqlStore,
) -> None:
    # Across jobs, up to the limit; a job without a free slot keeps its parked instances.
    await define(store, "a")
    await define(store, "b")
    await define(store, "full", max_concurrency=1, on_limit="wait")
    [first] = await enqueue(store, "a")
    await store.mark_published([first.id])
    await asyncio.sleep(0.05)
    second = await enqueue(store, "b", n=2)  # published together: by id
    await store.mark_published([i.id for i in second])
    await asyncio.sleep(0.05)
    never = await enqueue(store, "a")  # its publisher died before sending it
    running, parked = await enqueue(store, "full", n=2)
    claimed = await store.claim([running.id, parked.id], "w1", 30, ["full"])
    assert claimed.waiting == [parked.id]
    await asyncio.sleep(NEVER_PUBLISHED_GRACE_S + 0.1)
    order = [never[0].id, first.id, *sorted(i.id for i in second)]
    assert [i.id for i in await store.unpublished(0.1)] == order
    assert [i.id for i in await store.unpublished(0.1, limit=2)] == order[:2]


async def test_the_sweep_pages_through_the_published_after_the_last_one_it_saw(
    store: SqlStore,
) -> None:
    """A page of published instances starts after ``after`` (publication time, id): through
    ties of one publication time (a batch is marked at once) in id order, across jobs. The
    never published come first on every page: they are not part of the walk."""
    await define(store, "a")
    await define(store, "b")
    [first] = await enqueue(store, "b")
    await store.mark_published([first.id])
    await asyncio.sleep(0.05)
    batch = [*await enqueue(store, "a", n=3), *await enqueue(store, "b", n=2)]
    await store.mark_published([i.id for i in batch])  # five ties
    never = await enqueue(store, "a")
    await asyncio.sleep(NEVER_PUBLISHED_GRACE_S + 0.1)
    walk = [first.id, *sorted(i.id for i in batch)]
    seen: list[UUID] = []
    after = None
    for _ in range(4):
        page = await store.unpublished(0.1, limit=3, after=after)
        assert page[0].id == never[0].id
        published = [i for i in page if i.published_at is not None]
        seen += [i.id for i in published]
        if len(page) < 3:
            break
        last = published[-1]
        assert last.published_at is not None
        after = (last.published_at, last.id)
    assert seen == walk


async def test_every_enqueued_instance_is_paged_once_in_id_order(store: SqlStore) -> None:
    # The leader's republication after the bus lost everything pages through them by id.
    await define(store, "job")
    enqueued = await enqueue(store, n=7)
    running = enqueued.pop()
    assert (await store.claim([running.id], "w1", 30, ["job"])).claimed
    await enqueue(store, n=2, held=True)  # Scheduled: not listed
    pages, after = [], None
    while page := await store.all_enqueued(after, limit=2):
        pages.append([i.id for i in page])
        after = page[-1].id
    assert [len(p) for p in pages] == [2, 2, 2]
    assert [i for p in pages for i in p] == sorted(i.id for i in enqueued)


async def test_silent_workers_are_marked_dead(store: SqlStore) -> None:
    info = WorkerInfo(id="w1", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await store.register_worker(info)
    assert await store.mark_dead_workers(60) == []
    await asyncio.sleep(0.2)
    assert await store.mark_dead_workers(0.1) == ["w1"]
    assert await store.mark_dead_workers(0.1) == []


async def test_retention_keeps_each_recurring_jobs_latest_tick(store: SqlStore) -> None:
    """The leader plans a job's next tick from its latest one: deleted, the next re-plan took
    it for missed and fired it again."""
    await define(store, "daily", cron="0 0 * * *")
    await define(store, "hourly", cron="0 * * * *")
    lease = await store.acquire_leadership(0, "leader", 30.0)
    assert lease is not None
    now = await store.now()
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    ticks = [day - timedelta(days=n) for n in (3, 2, 1)]
    skipped = "misfire"  # (recorded Skipped: terminal, finished as created)
    made = await store.fire(
        lease,
        [
            NewInstance(
                job_key="daily", source=InstanceSource.CRON, scheduled_at=t, skip_reason=skipped
            )
            for t in ticks
        ]
        + [
            NewInstance(
                job_key="hourly", source=InstanceSource.CRON, scheduled_at=day, skip_reason=skipped
            )
        ],
    )
    assert {i.state for i in made} == {S.SKIPPED}
    [manual] = await enqueue(store, "daily")
    await store.request_cancel(manual.id, "ops")  # a manual trigger: no tick, it goes
    cutoff = await store.now() + timedelta(seconds=1)
    assert await store.delete_finished_before(cutoff, fence=lease) == 3
    left = (await store.list_instances(InstanceFilter(), limit=10)).items
    assert sorted((i.job_key, i.scheduled_at) for i in left) == [
        ("daily", ticks[-1]),
        ("hourly", day),
    ]
    assert await store.last_occurrences(["daily", "hourly"]) == {"daily": ticks[-1], "hourly": day}
    # A later tick makes the one before it deletable.
    await store.fire(
        lease,
        [
            NewInstance(
                job_key="daily", source=InstanceSource.CRON, scheduled_at=day, skip_reason=skipped
            )
        ],
    )
    assert await store.delete_finished_before(await store.now() + timedelta(seconds=1)) == 1
    assert await store.last_occurrences(["daily"]) == {"daily": day}


async def test_the_leaders_reads_take_more_jobs_than_a_statement_takes_parameters(
    store: SqlStore,
) -> None:
    """The leader asks for the latest tick, and the definition, of every active recurring job
    at once: past 32,767 keys (asyncpg's bound; SQLite's is 32,766) the read was refused, and
    the leader's duties restarted for ever without firing anything."""
    await define(store, "job-00007", cron="0 0 * * *")
    lease = await store.acquire_leadership(0, "leader", 30.0)
    assert lease is not None
    tick = (await store.now()).replace(hour=0, minute=0, second=0, microsecond=0)
    await store.fire(
        lease, [NewInstance(job_key="job-00007", source=InstanceSource.CRON, scheduled_at=tick)]
    )
    keys = [f"job-{n:05d}" for n in range(40_000)]
    assert await store.last_occurrences(keys) == {"job-00007": tick}
    assert [d.key for d in await store.list_definitions(keys)] == ["job-00007"]


async def test_retention_deletes_only_old_terminal_instances(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=5)
    old_done, running = await enqueue(store, n=2)
    await store.request_cancel(old_done.id, "ops")
    await store.claim([running.id], "w1", 10, ["job"])
    cutoff = await store.now() + timedelta(seconds=1)
    [recent] = await enqueue(store)
    assert await store.delete_finished_before(await store.now() - timedelta(hours=1)) == 0
    assert await store.delete_finished_before(cutoff) == 1
    assert await store.delete_finished_before(cutoff) == 0
    assert await store.transitions(old_done.id) == []
    assert (await store.get_instance(running.id)).state is S.PROCESSING
    assert (await store.get_instance(recent.id)).state is S.ENQUEUED


async def test_instances_pinned_to_a_gone_worker_fall_back_or_fail(store: SqlStore) -> None:
    await define(store, "any_job", max_concurrency=5)
    await define(store, "strict_job", pin_fallback="fail")
    lease = await _lead(store)
    live = WorkerInfo(id="alive", host="h", pid=1, queues=("default",), capacity=1, version="x")
    await store.register_worker(live)
    [kept] = await enqueue(store, "any_job", pinned_worker="alive")
    [moved] = await enqueue(store, "any_job", pinned_worker="ghost")
    [failed] = await enqueue(store, "strict_job", pinned_worker="ghost")
    [(unpinned, was_pinned_to)] = await store.resolve_orphaned_pins(lease)
    assert unpinned.id == moved.id and unpinned.pinned_worker is None
    assert was_pinned_to == "ghost"
    assert unpinned.state is S.ENQUEUED and unpinned.published_at is None
    assert (await store.get_instance(kept.id)).pinned_worker == "alive"
    gone = await store.get_instance(failed.id)
    assert gone.state is S.TERMINATED and gone.reason == "pinned worker gone"


async def test_instances_pinned_to_a_live_worker_without_their_job_fall_back_after_a_while(
    store: SqlStore,
) -> None:
    """Nothing runs an instance pinned to a live worker that has not registered its job: that
    worker puts its entry back, and another's claim refuses the pin. Once it has waited the
    unknown-job timeout, the job's ``pin_fallback`` applies, with a reason that says why."""
    await define(store, "any_job", max_concurrency=5)
    await define(store, "strict_job", pin_fallback="fail")
    lease = await _lead(store)
    worker = WorkerInfo(
        id="other-app",
        host="h",
        pid=1,
        queues=("default",),
        capacity=1,
        version="x",
        jobs=("strict_job",),
    )
    await store.register_worker(worker)
    [moved] = await enqueue(store, "any_job", pinned_worker="other-app")
    [knows] = await enqueue(store, "strict_job", pinned_worker="other-app")
    assert await store.resolve_orphaned_pins(lease, 60.0) == []  # (not waited long enough)
    await asyncio.sleep(0.3)
    [(unpinned, was_pinned_to)] = await store.resolve_orphaned_pins(lease, 0.2)
    assert (unpinned.id, unpinned.pinned_worker, was_pinned_to) == (moved.id, None, "other-app")
    assert unpinned.reason == EndReason.PIN_UNAWARE_UNPINNED and unpinned.state is S.ENQUEUED
    assert (await store.get_instance(knows.id)).pinned_worker == "other-app"  # it registered it
    await store.register_worker(replace(worker, jobs=()))  # a release without the job
    [failed] = await enqueue(store, "strict_job", pinned_worker="other-app")
    await asyncio.sleep(0.3)
    assert await store.resolve_orphaned_pins(lease, 0.2) == []
    for instance in (knows, failed):
        ended = await store.get_instance(instance.id)
        assert ended.state is S.TERMINATED and ended.reason == EndReason.PIN_UNAWARE


async def test_retry_on_the_same_worker_pins_the_retry(store: SqlStore) -> None:
    await define(store, "job", retries=1, retry_on_same_worker=True, backoff={"kind": "none"})
    [inst] = await enqueue(store)
    [c] = (await store.claim([inst.id], "w7", 10, ["job"])).claimed
    await store.complete([Outcome(inst.id, c.token, S.FAILED)])
    retry = await store.get_instance(inst.id)
    assert retry.state is S.ENQUEUED and retry.pinned_worker == "w7"
    assert (await store.claim([inst.id], "w8", 10, ["job"])).claimed == []
    assert (await store.claim([inst.id], "w7", 10, ["job"])).claimed


async def test_a_fire_naming_a_deleted_job_writes_nothing(store: SqlStore) -> None:
    """A job deleted since the leader read it: the whole fire is refused, none of it written."""
    await define(store, "tick", cron="* * * * * *")
    lease = await _lead(store)
    tick = (await store.now()).replace(microsecond=0)
    records = [
        NewInstance(job_key=key, source=InstanceSource.CRON, scheduled_at=tick)
        for key in ("tick", "gone")
    ]
    with pytest.raises(JobNotFoundError):
        await store.fire(lease, records)
    assert await store.count_by_state() == {}


async def test_a_fire_planned_under_an_older_version_writes_nothing(store: SqlStore) -> None:
    """A job paused (or edited) after the leader planned its tick, its event not yet applied:
    the fire names the version each job was planned under, and writes nothing while one of
    them is stored at another; the jobs that changed come back. At the planned versions the
    same fire writes every tick."""
    await define(store, "kept", cron="* * * * * *")
    await define(store, "paused", cron="* * * * * *")
    planned = {d.key: d.version for d in await store.list_definitions(["kept", "paused"])}
    await store.set_paused("paused", True, "test")
    lease = await _lead(store)
    tick = (await store.now()).replace(microsecond=0)
    records = [
        NewInstance(job_key=key, source=InstanceSource.CRON, scheduled_at=tick)
        for key in ("kept", "paused")
    ]
    with pytest.raises(DefinitionsChangedError) as refused:
        await store.fire(lease, records, planned=planned)
    assert refused.value.keys == {"paused"}
    assert await store.count_by_state() == {}
    current = {d.key: d.version for d in await store.list_definitions(["kept", "paused"])}
    fired = await store.fire(lease, records[:1], planned={"kept": current["kept"]})
    assert [i.job_key for i in fired] == ["kept"]
