"""Recording a batch of outcomes: a batch without a Failed outcome is one statement on its own,
one with a Failed outcome is one transaction with the retries that follow. Both kinds of batch
end every attempt, give the slots back and write the history."""

from __future__ import annotations

from uuid import uuid4

from jobplane.domain.models import ErrorInfo, Outcome
from jobplane.domain.states import InstanceState as S
from jobplane.store.moves import ALIKE_MOST, alike_outcomes
from jobplane.store.sql import SqlStore
from tests.store_helpers import define, enqueue, slots_used


async def test_a_batch_without_failures_ends_each_attempt_and_frees_the_slots(
    store: SqlStore,
) -> None:
    await define(store, "job", max_concurrency=3)
    instances = await enqueue(store, n=3)
    claims = (await store.claim([i.id for i in instances], "w1", 10, ["job"])).claimed
    assert await slots_used(store) == 3
    ok, cancelled, stale = claims
    ended = await store.complete(
        [
            Outcome(ok.instance.id, ok.token, S.SUCCEEDED, result={"n": 1}),
            Outcome(cancelled.instance.id, cancelled.token, S.CANCELLED),
            Outcome(stale.instance.id, stale.token + 1_000, S.SUCCEEDED),  # fenced off
        ]
    )
    assert ended == {ok.instance.id: S.SUCCEEDED, cancelled.instance.id: S.CANCELLED}
    assert await slots_used(store) == 1  # the fenced attempt's slot is still taken
    assert (await store.get_instance(ok.instance.id)).result == {"n": 1}
    history = [t.to_state for t in await store.transitions(stale.instance.id)]
    assert history == [S.ENQUEUED, S.PROCESSING]


async def test_a_batch_with_failures_moves_them_on_with_the_others(store: SqlStore) -> None:
    await define(store, "job", max_concurrency=3, retries=1)
    instances = await enqueue(store, n=3)
    claims = (await store.claim([i.id for i in instances], "w1", 10, ["job"])).claimed
    ok, retried, delayed = claims
    error = ErrorInfo("ValueError", "boom", "Traceback ...")
    ended = await store.complete(
        [
            Outcome(ok.instance.id, ok.token, S.SUCCEEDED),
            Outcome(retried.instance.id, retried.token, S.FAILED, error=error),
            Outcome(delayed.instance.id, delayed.token, S.FAILED, error=error, retry_delay_s=60),
        ]
    )
    assert ended == {
        ok.instance.id: S.SUCCEEDED,
        retried.instance.id: S.ENQUEUED,
        delayed.instance.id: S.SCHEDULED,
    }
    assert await slots_used(store) == 0
    history = [t.to_state for t in await store.transitions(retried.instance.id)]
    assert history == [S.ENQUEUED, S.PROCESSING, S.FAILED, S.ENQUEUED]
    assert (await store.get_instance(delayed.instance.id)).retries_used == 1


async def test_alike_outcomes_are_each_fenced_by_their_own_token(store: SqlStore) -> None:
    # Successes alike but for their instance (SQLite records them by one move): each still
    # lands only on its own attempt, a stale token among them is fenced off alone, an outcome
    # with a result of its own keeps it, and an instance given twice is recorded once.
    await define(store, "job", max_concurrency=10)
    instances = await enqueue(store, n=6)
    claims = (await store.claim([i.id for i in instances], "w1", 10, ["job"])).claimed
    a, b, stale, c, d, own = claims
    ended = await store.complete(
        [
            Outcome(a.instance.id, a.token, S.SUCCEEDED),
            Outcome(b.instance.id, b.token, S.SUCCEEDED),
            Outcome(stale.instance.id, stale.token + 1_000, S.SUCCEEDED),  # fenced off
            Outcome(c.instance.id, c.token, S.SUCCEEDED),
            Outcome(a.instance.id, a.token, S.SUCCEEDED),  # again: already ended
            Outcome(own.instance.id, own.token, S.SUCCEEDED, result={"n": 7}),
            Outcome(d.instance.id, d.token, S.SUCCEEDED),
        ]
    )
    done = [a, b, c, d, own]
    assert ended == {x.instance.id: S.SUCCEEDED for x in done}
    assert await slots_used(store) == 1  # the fenced attempt's slot only
    for x in done:
        history = [t.to_state for t in await store.transitions(x.instance.id)]
        assert history == [S.ENQUEUED, S.PROCESSING, S.SUCCEEDED]
    assert (await store.get_instance(stale.instance.id)).state is S.PROCESSING
    assert (await store.get_instance(own.instance.id)).result == {"n": 7}
    assert (await store.get_instance(d.instance.id)).result is None


async def test_one_instance_s_outcomes_in_a_batch_are_recorded_in_their_order(
    store: SqlStore,
) -> None:
    # Grouped by what they write, a later outcome of an instance must still come after its
    # earlier one: here the failure is recorded (and retried), the success after it fenced.
    await define(store, "job", max_concurrency=10, retries=3)
    instances = await enqueue(store, n=2)
    y, x = (await store.claim([i.id for i in instances], "w1", 10, ["job"])).claimed
    error = ErrorInfo("ValueError", "boom", "Traceback ...")
    ended = await store.complete(
        [
            Outcome(y.instance.id, y.token, S.SUCCEEDED),
            Outcome(x.instance.id, x.token, S.FAILED, error=error),
            Outcome(x.instance.id, x.token, S.SUCCEEDED),
        ]
    )
    assert ended == {y.instance.id: S.SUCCEEDED, x.instance.id: S.ENQUEUED}
    history = [t.to_state for t in await store.transitions(x.instance.id)]
    assert history == [S.ENQUEUED, S.PROCESSING, S.FAILED, S.ENQUEUED]


def test_alike_outcomes_are_moved_a_thousand_at_most_and_in_order() -> None:
    ids = [uuid4() for _ in range(2_500)]
    done = [Outcome(i, 1, S.SUCCEEDED) for i in ids]
    other = Outcome(ids[0], 1, S.SUCCEEDED, result={"n": 1})  # ids[0] again: a later run
    groups = alike_outcomes([*done, other])
    assert [len(g) for g in groups] == [ALIKE_MOST, ALIKE_MOST, 500, 1]
    assert [o for g in groups for o in g] == [*done, other]
