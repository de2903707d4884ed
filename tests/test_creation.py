"""Instances are created by one rule, whichever path creates them: the store's batch creation
(retries, bulk triggers; on Postgres its own statement), the leader's cron fire (on Postgres
one fenced statement), the single trigger of the API and the client (``create_published``;
on Postgres its own one-statement form) and the in-transaction ``enqueue``. Each path is run
over the same requests on both backends and the rows compared."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import pytest

from jobplane.domain.models import Instance, InstanceSource, NewInstance
from jobplane.domain.states import InstanceState as S
from jobplane.enqueue import enqueue_async
from jobplane.store.sql import SqlStore
from tests.store_helpers import define

#: (name, request) over the store's clock ``now``: what each path is asked to create.
Request = Callable[[datetime], dict[str, Any]]
REQUESTS: list[tuple[str, Request]] = [
    ("now", lambda now: {}),
    ("run_at in the past", lambda now: {"run_at": now - timedelta(minutes=5)}),
    ("run_at in the future", lambda now: {"run_at": now + timedelta(hours=1)}),
    ("held", lambda now: {"held": True}),
    ("priority", lambda now: {"priority": 7}),
]

Path = Callable[[SqlStore, NewInstance], Awaitable[UUID]]


async def _batch(store: SqlStore, new: NewInstance) -> UUID:
    [made] = await store.create_instances([new])
    return made.id


async def _single(store: SqlStore, new: NewInstance) -> UUID:
    definition = await store.get_definition(new.job_key)
    return (await store.create_published(new, definition)).id


async def _fire(store: SqlStore, new: NewInstance) -> UUID:
    """The leader's cron fire (on Postgres its own fenced statement)."""
    lease = await store.acquire_leadership(0, "creation-test", 30)  # (renewed once held)
    assert lease is not None
    [made] = await store.fire(lease, [new])
    return made.id


async def _enqueue(store: SqlStore, new: NewInstance) -> UUID:
    async with store.engine.begin() as conn:  # the application's own transaction
        return await enqueue_async(
            conn, new.job_key, new.args, run_at=new.run_at, priority=new.priority, hold=new.held
        )


PATHS: dict[str, Path] = {
    "batch": _batch,
    "fire": _fire,
    "single": _single,
    "enqueue": _enqueue,
}


def _row(instance: Instance) -> tuple[Any, ...]:
    return (
        instance.state,
        instance.queue,
        instance.priority,
        instance.run_at,
        instance.finished_at is None,
    )


async def test_every_creation_path_follows_the_one_rule(store: SqlStore) -> None:
    await define(store, "job", queue="mail", priority=3)
    now = await store.now()
    made: dict[str, dict[str, Instance]] = {}
    for name, request in REQUESTS:
        for path_name, path in PATHS.items():
            new = NewInstance(job_key="job", args={"n": name}, **request(now))
            made.setdefault(name, {})[path_name] = await store.get_instance(await path(store, new))
    for name, by_path in made.items():
        rows = {path_name: _row(instance) for path_name, instance in by_path.items()}
        assert len(set(rows.values())) == 1, (name, rows)
    # The rule itself: a due time in the past is Enqueued on every path (enqueue() used to
    # make it Scheduled), a held instance has no due time.
    assert {i.state for i in made["run_at in the past"].values()} == {S.ENQUEUED}
    assert {i.state for i in made["run_at in the future"].values()} == {S.SCHEDULED}
    assert {(i.state, i.run_at) for i in made["held"].values()} == {(S.SCHEDULED, None)}
    assert {(i.queue, i.priority) for i in made["now"].values()} == {("mail", 3)}
    assert {i.priority for i in made["priority"].values()} == {7}
    # Each creation has its history row, recorded as created in that state.
    for by_path in made.values():
        for instance in by_path.values():
            [first, *_] = await store.transitions(instance.id)
            assert (first.from_state, first.to_state) == (None, instance.state)


async def test_a_skipped_occurrence_is_finished_at_creation(store: SqlStore) -> None:
    await define(store, "job")
    now = await store.now()
    [skipped] = await store.create_instances(
        [NewInstance(job_key="job", scheduled_at=now, skip_reason="misfire")]
    )
    assert skipped.state is S.SKIPPED and skipped.finished_at is not None
    assert skipped.reason == "misfire"


async def test_a_batch_of_mixed_requests_creates_each_as_alone(store: SqlStore) -> None:
    # The batch statements receive a column as one array (on Postgres, a column NULL in every
    # record as an empty one, padded with NULLs by the statement): in one batch of every
    # request together each row gets its own values, as when it is created alone.
    await define(store, "job", queue="mail", priority=3)
    now = await store.now()
    alone = {
        name: _row(
            await store.get_instance(await _single(store, NewInstance(job_key="job", **r(now))))
        )
        for name, r in REQUESTS
    }
    lease = await store.acquire_leadership(0, "creation-test", 30)
    assert lease is not None
    for create in (store.create_instances, lambda new: store.fire(lease, new)):
        batch = [NewInstance(job_key="job", **request(now)) for _, request in REQUESTS]
        made = await create(batch)
        assert [i.id for i in made] == [n.id for n in batch]
        for (name, _), instance in zip(REQUESTS, made, strict=True):
            assert _row(instance) == alone[name], name
            assert instance == await store.get_instance(instance.id)


@pytest.mark.parametrize("creation", ["batch", "fire"])
async def test_a_creation_answers_each_instance_as_it_stored_it(
    store: SqlStore, creation: str
) -> None:
    # The batch's and the fire's statements return only the columns the insert decides; the
    # rest of each instance comes from its record: every field must still be the stored one.
    await define(store, "job", queue="mail", priority=3)
    now = await store.now()
    lease = await store.acquire_leadership(0, "creation-test", 30)
    assert lease is not None
    batch = [
        NewInstance(job_key="job", source=InstanceSource.CRON, scheduled_at=now, actor="cron"),
        NewInstance(
            job_key="job",
            source=InstanceSource.CRON,
            scheduled_at=now - timedelta(seconds=1),
            skip_reason="misfire",
        ),
        NewInstance(job_key="job", args={"b": [1, 2.5, "x", None], "a": {"c": True}}),
        # Floats whose JSON has an exponent: jsonb writes them out in full (1e+23 reads back
        # as the integer), so the answer must be what was stored, not what was sent.
        NewInstance(job_key="job", args={"big": 1e23, "edge": 1e16, "max": 1.7976931348623157e308}),
        NewInstance(job_key="job", args=[3, "y"], queue="other", priority=9),
        NewInstance(job_key="job", pinned_worker="w1", run_at=now + timedelta(hours=1)),
        NewInstance(job_key="job", idempotency_key="once", args={"n": 1}),
        NewInstance(job_key="job", held=True),
    ]
    if creation == "fire":
        made = await store.fire(lease, batch)
    else:
        made = await store.create_instances(batch, published=True)
    assert [i.id for i in made] == [n.id for n in batch]
    for instance in made:
        assert instance == await store.get_instance(instance.id)
    assert made[6].idempotency_fingerprint is not None
