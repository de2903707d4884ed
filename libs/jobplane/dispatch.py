"""Triggering jobs: create instances in the store, then publish the Enqueued ones on the bus.

The store write comes first and is the acknowledgement: once :meth:`Dispatcher.trigger`
returns, the instance exists and will reach a terminal state. Publishing is the fast path; an
instance whose message is lost (publish failed, Redis restarted) stays Enqueued with an old or
empty ``published_at`` and is republished by the scheduler's sweep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from jobplane import telemetry
from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.domain.limits import bulk_retry_key, check_json
from jobplane.domain.models import (
    BulkCancel,
    BulkRetry,
    Instance,
    InstanceFilter,
    JobDefinition,
    LeaderLease,
    NewInstance,
)
from jobplane.domain.options import check_priority
from jobplane.domain.states import InstanceState
from jobplane.errors import (
    BusUnavailableError,
    IllegalTransitionError,
    InstanceNotFoundError,
    InvalidOptionsError,
    JobNotFoundError,
    StaleDefinitionError,
    StoreConflictError,
)
from jobplane.errors import (
    InvalidArgumentsError as InvalidArgumentsError,  # re-exported
)
from jobplane.errors import JobDisabledError as JobDisabledError  # re-exported
from jobplane.publishing import CreatedPublication as CreatedPublication  # re-exported
from jobplane.publishing import Publisher
from jobplane.store.abc import DispatchStore
from jobplane.triggering import (
    check_request,
    held_in_debug,
    retriable,
    retry_request,
    trigger_request,
)

logger = logging.getLogger(__name__)


RETRY_BATCH = 500
#: Tries of a single trigger whose job's definition is edited while it is being triggered.
STALE_TRIES = 5
#: The name of the tasks that send single triggers' messages (see :meth:`Dispatcher._post`).
SEND_TASK = "jobplane.dispatch.send"


class Dispatcher(Publisher):
    """Creates and publishes instances. Does not own the store or the bus.

    Used as ``async with Dispatcher(...) as dispatcher``, a single trigger returns once its
    instance is committed and its message is sent by a task right after (see :meth:`_post`);
    leaving the block waits for those sends (:meth:`flush`), so leave it before closing the
    bus. Otherwise a trigger returns once its message is sent too."""

    def __init__(
        self,
        store: DispatchStore,
        bus: Bus,
        *,
        hold_triggered: bool = False,
        fence: LeaderLease | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        #: The leader's lease when the scheduler publishes: its ``published_at`` bookkeeping
        #: is a leader write, fenced by the term like the others.
        self.fence = fence
        #: Debug mode: instances triggered for triggered jobs are held (Scheduled with no due
        #: time) until someone runs them (:meth:`run_now`).
        self.hold_triggered = hold_triggered
        #: Definitions as last read, by key: a single trigger is validated against these and
        #: the store refuses it if the stored version moved on (see :meth:`_trigger_one`).
        self._definitions: dict[str, JobDefinition] = {}
        #: The last send failed (the bus is out of reach): see :meth:`publish`.
        self._bus_failed = False
        #: Single triggers' instances, committed and marked, whose messages are still to be
        #: sent (see :meth:`_post`), and the task sending them, while one runs.
        self._outbox: list[Instance] = []
        self._sender: asyncio.Task[None] | None = None
        #: Every send task still running, for :meth:`flush`.
        self._sending: set[asyncio.Task[None]] = set()
        #: Inside ``async with``: single triggers' messages are sent in the background.
        self._background = False

    async def __aenter__(self) -> Dispatcher:
        self._background = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._background = False
        await self.flush()

    async def flush(self) -> None:
        """Wait until the message of every single trigger made so far has been sent (or, if
        the bus could not take it, its publication mark cleared for the sweep)."""
        while self._sending:
            await asyncio.wait(set(self._sending))

    async def trigger(
        self,
        key: str,
        args: Any = None,
        *,
        run_at: datetime | None = None,
        delay: timedelta | None = None,
        priority: int | None = None,
        pinned_worker: str | None = None,
        idempotency_key: str | None = None,
        actor: str = "client",
    ) -> Instance:
        """Create one instance of ``key`` and publish it if it is due now. Raises
        IdempotencyConflictError when ``idempotency_key`` was used for another request."""
        now = await self.store.now() if delay is not None else None
        request = trigger_request(
            key,
            args,
            now=now,
            run_at=run_at,
            delay=delay,
            priority=priority,
            pinned_worker=pinned_worker,
            idempotency_key=idempotency_key,
            actor=actor,
        )
        [instance] = await self.trigger_many([request])
        return instance

    async def trigger_many(self, requests: Sequence[NewInstance]) -> list[Instance]:
        """Validate, create in one batch, publish what is Enqueued. Raises JobNotFoundError,
        JobDisabledError or InvalidArgumentsError before anything is created. In the hold
        debug mode, triggers of triggered jobs are created held."""
        if len(requests) == 1 and self.fence is None:
            try:
                return [await self._trigger_one(requests[0])]
            except InvalidOptionsError as exc:
                exc.item = 0
                raise
        definitions = {
            d.key: d for d in await self.store.list_definitions({r.job_key for r in requests})
        }
        for n, request in enumerate(requests):
            try:
                check_json(request.args, "args")
                check_priority(request.priority)
                definition = definitions.get(request.job_key)
                if definition is None:
                    continue  # create_instances raises JobNotFoundError with the key
                await self._checked(request, definition)  # (a replay stands: as inserted)
            except InvalidOptionsError as exc:
                exc.item = n  # which request of the batch
                raise
        if self.hold_triggered:
            requests = [
                replace(r, held=True) if held_in_debug(r, definitions.get(r.job_key)) else r
                for r in requests
            ]
        with telemetry.span("jobplane.trigger", source="trigger", instances=len(requests)):
            return await self._create_and_publish(requests)

    async def _trigger_one(self, request: NewInstance) -> Instance:
        """One request, one database statement and one bus round trip: validated against the
        definition this dispatcher remembers, created only if that is still the stored
        version (else read again and decided again), recorded as published in the same
        statement, then published."""
        check_json(request.args, "args")
        check_priority(request.priority)
        for _ in range(STALE_TRIES):
            definition = await self._definition(request.job_key)
            try:
                check_request(request, definition)
            except (JobDisabledError, InvalidArgumentsError):
                # Refused by what is remembered: ask the store before answering (the job
                # may have been enabled, or given a new schema, since).
                self._definitions.pop(request.job_key, None)
                definition = await self._definition(request.job_key)
                earlier = await self._checked(request, definition)
                if earlier is not None:
                    return earlier
            new = request
            if self.hold_triggered and held_in_debug(request, definition):
                new = replace(request, held=True)
            with telemetry.span("jobplane.trigger", source="trigger", instances=1):
                try:
                    instance = await self.store.create_published(new, definition)
                except StaleDefinitionError:
                    # Edited or deleted since it was remembered: nothing was created.
                    self._definitions.pop(request.job_key, None)
                    continue
                if instance.id != request.id or instance.state is not InstanceState.ENQUEUED:
                    await self.publish([instance])  # held, delayed, or an earlier one replayed
                elif self._background:
                    self._post(instance)
                elif await self._publish_created([instance]):  # not sent, and unmarked
                    instance = replace(instance, published_at=None)
            return instance
        raise StoreConflictError(f"job {request.job_key!r} kept changing while triggered")

    async def _create_and_publish(self, requests: Sequence[NewInstance]) -> list[Instance]:
        """Create a batch, its Enqueued instances recorded as published by the insert itself
        where the store can (one write: a separate mark of 1,000 rows was a third of a bulk
        trigger's time, docs/benchmarks.md), then send them; :meth:`publish_created` clears
        the marks of a send that fails and marks and sends the rest (an earlier instance an
        idempotency key replayed, or a store that did not mark). A leader's dispatcher keeps
        its marks fenced, in :meth:`publish`."""
        published = self.marks_first and self.fence is None
        instances = await self.store.create_instances(requests, published=published)
        return await self.publish_created(instances, {r.id for r in requests})

    async def _checked(self, request: NewInstance, definition: JobDefinition) -> Instance | None:
        """Raise JobDisabledError or InvalidArgumentsError unless ``definition`` takes
        ``request``, or it replays a request taken before the job was disabled (or its schema
        changed): then its first instance. A client retrying after a lost answer must not read
        "disabled" as "not created"."""
        try:
            check_request(request, definition)
        except (JobDisabledError, InvalidArgumentsError):
            earlier = await self.store.replay_of(request)
            if earlier is None:
                raise
            return earlier
        return None

    async def _definition(self, key: str) -> JobDefinition:
        """The definition of ``key`` as this dispatcher last read it (the store checks the
        version at each write); read from the store when not remembered. Raises
        JobNotFoundError."""
        found = self._definitions.get(key)
        if found is None:
            stored = await self.store.list_definitions([key])
            if not stored:
                raise JobNotFoundError(key)
            found = self._definitions[key] = stored[0]
        return found

    def _post(self, instance: Instance) -> None:
        """Send the message of an instance that :meth:`DispatchStore.create_published`
        committed and recorded as published, in the background (inside ``async with``): the
        trigger is acknowledged by its commit; its caller need not wait for the bus too. The
        send overlaps the caller's next round trip, and the messages of triggers made while
        one is under way (requests in flight in the API) go out together, in one call, next.
        Nothing is lost if this process dies before the send: the instance is committed and
        marked, and the sweep republishes a marked, unclaimed instance once its mark is older
        than the republish threshold (as when the process dies between a commit and its send).
        With tracing on, each message is sent by a task of its own, which inherits the
        trigger's span: the publish span is its child, one trace per instance."""
        loop = asyncio.get_running_loop()
        if telemetry.tracer() is not None:
            self._track(loop.create_task(self._publish_created([instance]), name=SEND_TASK))
            return
        self._outbox.append(instance)
        if self._sender is None:
            self._sender = self._track(loop.create_task(self._send_outbox(), name=SEND_TASK))

    def _track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return task

    async def _send_outbox(self) -> None:
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                await self._publish_created(batch)
        finally:
            self._sender = None
            if self._outbox:  # cancelled (the event loop is closing): marked, so swept
                logger.warning(
                    "%d triggered instance(s) not sent before the dispatcher stopped; the "
                    "sweep republishes them after its threshold",
                    len(self._outbox),
                    extra={"action": "dispatch.publish_abandoned"},
                )
                self._outbox = []

    async def _publish_created(self, instances: list[Instance]) -> bool:
        """Send instances that :meth:`DispatchStore.create_published` recorded as published;
        if the bus cannot take them, clear that record for the sweep (True: cleared)."""
        try:
            sent = await self._send(instances)
        except Exception:  # a send task has no caller to tell: log, and leave it to the sweep
            logger.exception(
                "could not send %d triggered instance(s)",
                len(instances),
                extra={"action": "dispatch.publish_failed"},
            )
            sent = False
        return not sent and await self._unmark([i.id for i in instances])

    async def run_now(self, instance_id: UUID, actor: str = "client") -> Instance:
        """Run a Scheduled instance (held or delayed) now: Enqueued and published. Raises
        IllegalTransitionError when it is not Scheduled, InstanceNotFoundError if unknown.

        The move records the publication itself where it may, and the message is then sent
        as a single trigger's is (:meth:`_trigger_one`): in the background inside ``async
        with`` (a cancelled caller cannot stop it), else awaited, its mark cleared if the send
        fails in any way. The instance answered says whether it was marked."""
        published = self.marks_first and self.fence is None
        instance = await self.store.run_now(instance_id, actor, published=published)
        if not instance.published_at:
            await self.publish([instance])  # (the bus failing, or a leader's fenced marks)
        elif self._background:
            self._post(instance)
        elif await self._publish_created([instance]):  # not sent, and unmarked
            instance = replace(instance, published_at=None)
        return instance

    async def cancel(self, instance_id: UUID, actor: str = "client") -> Instance:
        """Cancel an instance: a Scheduled or Enqueued one ends Cancelled at once; a running one
        gets ``cancel_requested``, and an event tells its worker within a second (its heartbeat
        reads the flag too, so a lost event only delays the cancel). Raises
        IllegalTransitionError for a terminal instance, InstanceNotFoundError if unknown."""
        instance = await self.store.request_cancel(instance_id, actor)
        if instance.state is InstanceState.PROCESSING:
            await self._announce_cancel(instance)
        return instance

    async def cancel_many(self, filter: InstanceFilter, *, limit: int, actor: str) -> BulkCancel:
        """Cancel up to ``limit`` instances that ``filter`` selects, in one store transaction
        (see :meth:`DispatchStore.cancel_many`); tell the workers of the running ones."""
        done = await self.store.cancel_many(filter, limit=limit, actor=actor)
        for instance in done.requested:
            if instance.state is InstanceState.PROCESSING:
                await self._announce_cancel(instance)
        return done

    async def retry(
        self, instance_id: UUID, actor: str = "client", idempotency_key: str | None = None
    ) -> Instance:
        """A new instance linked by ``retry_of`` for one terminal instance; the old one's
        history is never rewritten. The new one is validated like a trigger (the job must
        exist, be enabled and still accept the arguments). ``idempotency_key`` works as a
        trigger's: a replay returns the first retry. Raises IllegalTransitionError when the
        instance is not terminal, InstanceNotFoundError if unknown."""
        try:
            old = await self.store.get_instance(instance_id)
        except InstanceNotFoundError:
            # Retention may have deleted it since a retry under this key was made: a replay
            # of that request (its answer lost) still answers that retry, not "not found".
            if idempotency_key is not None:
                made = await self.store.retry_under_key(instance_id, idempotency_key)
                if made is not None:
                    return made
            raise
        if not old.state.is_terminal:
            raise IllegalTransitionError(old.state, "retry (only terminal instances)")
        [new] = await self.trigger_many([retry_request(old, actor, idempotency_key)])
        return new

    async def retry_selected(
        self,
        filter: InstanceFilter,
        *,
        limit: int,
        actor: str,
        before: UUID | None = None,
    ) -> BulkRetry:
        """A bulk retry: :meth:`retry_many` of up to ``limit`` of the terminal instances
        ``filter`` selects (Terminated ones if it names no state) that no bulk retry has
        retried yet, newest first, older than ``before`` if given. A state that is not terminal
        selects nothing: a retry applies to ended instances only."""
        selected = filter.for_retry()
        if selected is None:
            return BulkRetry()
        page = await self.store.list_instances(selected, limit=limit, before=before)
        retried, skipped = await self.retry_many(page.items, actor)
        return BulkRetry(retried, skipped, page.next_cursor)

    async def retry_many(
        self, instances: Sequence[Instance], actor: str
    ) -> tuple[list[tuple[UUID, Instance]], list[UUID]]:
        """A new instance linked by ``retry_of`` for each terminal one of ``instances``;
        return ``(old id, new instance)`` pairs and the ids skipped: not terminal, its job
        disabled, its arguments no longer valid for the job, or already retried by an earlier
        bulk retry (the ``retry-of:`` idempotency key makes a replay create nothing)."""
        definitions = {
            d.key: d for d in await self.store.list_definitions({i.job_key for i in instances})
        }
        skipped: list[UUID] = []
        requests: list[tuple[UUID, NewInstance]] = []
        for old in instances:
            if retriable(old, definitions.get(old.job_key)):
                requests.append((old.id, retry_request(old, actor, bulk_retry_key(old.id))))
            else:
                skipped.append(old.id)
        retried: list[tuple[UUID, Instance]] = []
        for start in range(0, len(requests), RETRY_BATCH):
            batch = requests[start : start + RETRY_BATCH]
            created = await self._create_and_publish([new for _, new in batch])
            for (old_id, new), instance in zip(batch, created, strict=True):
                if instance.id == new.id:
                    retried.append((old_id, instance))
                else:
                    skipped.append(old_id)  # an earlier bulk retry created it
        return retried, skipped

    async def _announce_cancel(self, instance: Instance) -> None:
        event = Event(
            EventKind.CANCEL_REQUESTED,
            {"instance_id": str(instance.id), "worker_id": instance.worker_id},
        )
        try:
            await self.bus.publish_event(event)
        except BusUnavailableError:
            logger.warning(
                "bus unavailable; instance %s is cancelled at its next heartbeat",
                instance.id,
                extra={"action": "dispatch.cancel_deferred", "instance_id": str(instance.id)},
            )
