"""Instances: list, read with history, cancel, retry, run now, batch trigger."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Header, Query, status

from jobplane.domain.models import InstanceFilter
from jobplane.domain.states import CANCEL_STATES, InstanceState
from jobplane.errors import InvalidOptionsError
from jobplane.triggering import trigger_request
from jobplane_api.deps import DispatcherDep, StoreDep
from jobplane_api.inputs import FilterTime, IdempotencyKey, ShortText
from jobplane_api.schemas import (
    PROBLEM_RESPONSES,
    TIME_FILTER,
    BatchTriggerIn,
    BulkCancelOut,
    BulkFilterIn,
    BulkRetryIn,
    BulkRetryOut,
    InstanceOut,
    InstancePage,
)
from jobplane_api.security import Operator, Principal, Viewer, actor_of

router = APIRouter(prefix="/api/v1/instances", tags=["instances"], responses=PROBLEM_RESPONSES)

#: What a bulk cancel selects when no states are given: every state it can change.
CANCELLABLE = CANCEL_STATES


@router.get("", summary="List instances", response_model=InstancePage, dependencies=[Viewer])
async def list_instances(
    store: StoreDep,
    job: ShortText | None = None,
    state: Annotated[list[InstanceState] | None, Query()] = None,
    created_after: Annotated[FilterTime | None, Query(description=TIME_FILTER)] = None,
    created_before: Annotated[FilterTime | None, Query(description=TIME_FILTER)] = None,
    scheduled_after: Annotated[FilterTime | None, Query(description=TIME_FILTER)] = None,
    scheduled_before: Annotated[FilterTime | None, Query(description=TIME_FILTER)] = None,
    worker: ShortText | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[UUID | None, Query(description="Cursor from the previous page.")] = None,
) -> InstancePage:
    """Newest first, keyset-paginated: pass ``next_cursor`` back as ``before``. Arguments,
    checkpoint and result larger than 1 KiB, and error tracebacks, are left out (named in
    each item's ``omitted``): read the instance for them."""
    page = await store.list_instances(
        InstanceFilter(
            job_key=job,
            states=tuple(state or ()),
            created_after=created_after,
            created_before=created_before,
            scheduled_after=scheduled_after,
            scheduled_before=scheduled_before,
            worker_id=worker,
        ),
        limit=limit,
        before=before,
    )
    return InstancePage(
        items=[InstanceOut.brief(i) for i in page.items], next_cursor=page.next_cursor
    )


BATCH_EXAMPLE = {
    "items": [
        {"job_key": "send_receipt", "args": {"order_id": 7}, "idempotency_key": "order-7"},
        {"job_key": "send_receipt", "args": {"order_id": 8}, "delay_s": 60, "priority": 2},
        {"job_key": "rebuild_index", "run_at": "2026-11-24T03:00:00Z", "pinned_worker": "w-1"},
    ]
}


@router.post(
    "/batch",
    summary="Trigger many instances",
    status_code=status.HTTP_201_CREATED,
    response_model=list[InstanceOut],
    openapi_extra={"requestBody": {"content": {"application/json": {"example": BATCH_EXAMPLE}}}},
)
async def batch_trigger(
    dispatcher: DispatcherDep,
    store: StoreDep,
    body: BatchTriggerIn,
    principal: Annotated[Principal, Operator],
) -> list[InstanceOut]:
    """Create up to 1,000 instances in one statement; all or none. An item's
    ``idempotency_key`` works as a single trigger's Idempotency-Key header: a replayed item
    stands for its first instance, and a key reused with a different request fails the whole
    batch with 409."""
    now = await store.now()
    requests = []
    for n, item in enumerate(body.items):
        if item.run_at is not None and item.delay_s is not None:
            raise InvalidOptionsError(f"items.{n}.delay_s", "give run_at or delay_s, not both")
        requests.append(
            trigger_request(
                item.job_key,
                item.args,
                now=now,
                run_at=item.run_at,
                delay=timedelta(seconds=item.delay_s) if item.delay_s is not None else None,
                priority=item.priority,
                pinned_worker=item.pinned_worker,
                idempotency_key=item.idempotency_key,
                actor=actor_of(principal),
            )
        )
    try:
        made = await dispatcher.trigger_many(requests)
    except InvalidOptionsError as exc:
        if exc.item is None:
            raise
        # The field as the body names it: which item ("args.n" alone named none of them).
        raise type(exc)(f"items.{exc.item}.{exc.field}", exc.reason) from None
    new = {r.id for r in requests}  # (an earlier instance a key replayed is checked as read)
    return [InstanceOut.of(i, args_checked=i.id in new) for i in made]


BULK_EXAMPLE = {
    "job": "send_receipt",
    "states": ["enqueued", "scheduled"],
    "created_after": "2026-11-22T00:00:00Z",
    "limit": 1000,
}


@router.post(
    "/cancel",
    summary="Cancel the instances a filter selects",
    response_model=BulkCancelOut,
    openapi_extra={"requestBody": {"content": {"application/json": {"example": BULK_EXAMPLE}}}},
)
async def bulk_cancel(
    dispatcher: DispatcherDep, body: BulkFilterIn, principal: Annotated[Principal, Operator]
) -> BulkCancelOut:
    """Up to ``limit`` instances that the filter selects, oldest first, in one transaction:
    Scheduled and Enqueued ones end Cancelled, running ones (Processing, or Failed and
    waiting for a retry) are told to stop. Only what a cancel changes is selected: a state
    it does not apply to selects nothing, and a running instance already told to stop is
    left out. Without ``states``, every state a cancel applies to. ``more`` says to call
    again."""
    done = await dispatcher.cancel_many(
        body.to_filter(CANCELLABLE), limit=body.limit, actor=actor_of(principal)
    )
    return BulkCancelOut.of(done)


@router.post(
    "/retry",
    summary="Retry the instances a filter selects",
    response_model=BulkRetryOut,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/json": {"example": {"job": "send_receipt", "states": ["terminated"]}}
            }
        }
    },
)
async def bulk_retry(
    dispatcher: DispatcherDep, body: BulkRetryIn, principal: Annotated[Principal, Operator]
) -> BulkRetryOut:
    """A new instance linked by ``retry_of`` for each of up to ``limit`` ended instances that
    the filter selects and no bulk retry has retried yet, newest first. Without ``states``,
    Terminated instances are selected; a state that is not terminal selects nothing. Skipped
    and counted: instances of a disabled job, or whose arguments the job no longer accepts.
    A replay is safe: what an earlier bulk retry retried is neither selected nor retried again.
    """
    done = await dispatcher.retry_selected(
        body.to_filter((InstanceState.TERMINATED,)),
        limit=body.limit,
        actor=actor_of(principal),
        before=body.before,
    )
    return BulkRetryOut.of(done)


@router.get(
    "/{instance_id}", summary="Get an instance", response_model=InstanceOut, dependencies=[Viewer]
)
async def get_instance(store: StoreDep, instance_id: UUID) -> InstanceOut:
    """The instance with its transitions, progress, checkpoint, result or error."""
    instance = await store.get_instance(instance_id)
    return InstanceOut.of(instance, await store.transitions(instance_id))


@router.post(
    "/{instance_id}/cancel",
    summary="Cancel an instance",
    response_model=InstanceOut,
)
async def cancel_instance(
    dispatcher: DispatcherDep, instance_id: UUID, principal: Annotated[Principal, Operator]
) -> InstanceOut:
    """Queued instances end Cancelled; a running one is told to stop. 409 when terminal."""
    return InstanceOut.of(await dispatcher.cancel(instance_id, actor_of(principal)))


@router.post("/{instance_id}/run", summary="Run a waiting instance now", response_model=InstanceOut)
async def run_instance(
    dispatcher: DispatcherDep, instance_id: UUID, principal: Annotated[Principal, Operator]
) -> InstanceOut:
    """A Scheduled instance (held by the debug mode ``JOBPLANE_DEBUG_HOLD_TRIGGERED``, or
    delayed) becomes Enqueued and is published at once. 409 when it is not Scheduled."""
    return InstanceOut.of(await dispatcher.run_now(instance_id, actor_of(principal)))


@router.post(
    "/{instance_id}/retry",
    summary="Retry a terminal instance",
    status_code=status.HTTP_201_CREATED,
    response_model=InstanceOut,
)
async def retry_instance(
    dispatcher: DispatcherDep,
    instance_id: UUID,
    principal: Annotated[Principal, Operator],
    idempotency_key: Annotated[IdempotencyKey | None, Header()] = None,
) -> InstanceOut:
    """A new instance linked by ``retry_of``; the old one's history is never rewritten.
    Replaying an ``Idempotency-Key`` (a client retrying this POST) returns the first retry
    instead of creating another; the key reused for another request (a retry of another
    instance, or a trigger) is a 409 and creates nothing."""
    new = await dispatcher.retry(instance_id, actor_of(principal), idempotency_key)
    return InstanceOut.of(new)
