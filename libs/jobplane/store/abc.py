"""The metadata store contract. Postgres is the source of truth; SQLite is the embedded default.

One interface per role (:class:`WorkerStore`, :class:`LeaderStore`, :class:`ApiStore`, built
from smaller ones they share); :class:`Store` is all of them, as the SQL stores implement it.

Every state change is one compare-and-set on the instance's current state (and, for writes made
for an attempt, its claim token), with its history record written in the same statement or
transaction. A write that matches nothing changed nothing and left no history: callers get
``None``/``False``/an empty list back, never an exception, because losing a race is normal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol
from uuid import UUID

from jobplane.auth import Role, TokenInfo
from jobplane.domain.models import (
    Bucket,
    BulkCancel,
    ClaimResult,
    DefinitionVersion,
    Instance,
    InstanceFilter,
    JobDefinition,
    JobSummary,
    Lags,
    LeaderLease,
    NewInstance,
    Outcome,
    Page,
    RunawaySlot,
    SchedulerReplica,
    Transition,
    WorkerInfo,
)
from jobplane.domain.states import InstanceState
from jobplane.store.abc_parts import DefinitionEdits as DefinitionEdits
from jobplane.store.abc_parts import DefinitionReads as DefinitionReads
from jobplane.store.abc_parts import Registration as Registration
from jobplane.store.abc_parts import StoreConnection as StoreConnection
from jobplane.store.abc_parts import WorkerReads as WorkerReads

#: A published Enqueued instance's place in the republish sweep's order: (publication time, id).
PublishedKey = tuple[datetime, UUID]


class DispatchStore(StoreConnection, DefinitionReads, Protocol):
    """What :class:`~jobplane.dispatch.Dispatcher` uses: creating instances, the publishing
    bookkeeping, and an operator's moves (cancel, run now)."""

    async def create_instances(
        self,
        new: Sequence[NewInstance],
        *,
        fence: LeaderLease | None = None,
        published: bool = False,
    ) -> list[Instance]:
        """Insert instances in one batch with their creation history, in order. With
        ``fence`` (a leader's lease) nothing is written unless that term is still live. With
        ``published``, a store may record the Enqueued ones as published in the same write
        (see :meth:`LeaderStore.fire`). Raises JobNotFoundError for an unknown key (nothing
        inserted). A cron occurrence whose (job key, scheduled time) exists, or an idempotency
        key already used for the job, is not inserted again: the existing one stands in."""

    async def create_published(self, new: NewInstance, definition: JobDefinition) -> Instance:
        """Insert one instance with its creation history, as :meth:`create_instances` does,
        only if its job's stored definition is still ``definition`` (the one the caller
        validated the request against: same version and same argument schema, which a
        worker's registration may change without a new version), and record an Enqueued one
        as published in the same write: the caller publishes it next and, if it cannot,
        calls :meth:`unmark_published`. An instance whose publisher died in between is
        republished by the sweep once its ``published_at`` is older than the republish
        threshold. Raises :class:`~jobplane.errors.StaleDefinitionError` when the stored
        definition differs or is gone (nothing inserted). An idempotency key already used
        for the job returns the existing instance (or raises IdempotencyConflictError)."""

    async def replay_of(self, new: NewInstance) -> Instance | None:
        """The instance an earlier request under ``new``'s idempotency key created, if that
        request was the same one; None if the key is unused (or ``new`` carries none). Raises
        IdempotencyConflictError if the key was used for another request."""

    async def retry_under_key(self, retry_of: UUID, key: str) -> Instance | None:
        """The retry of ``retry_of`` made under idempotency ``key``, if any (found even once
        retention deleted ``retry_of``)."""

    async def unmark_published(self, ids: Collection[UUID]) -> None:
        """Forget the publication of ``ids`` that are still Enqueued (their message never
        reached the bus): the sweep publishes them within its never-published grace."""

    async def mark_published(
        self, ids: Collection[UUID], *, fence: LeaderLease | None = None
    ) -> None:
        """Record that messages for ``ids`` are being handed to the bus (sets
        ``published_at``; the dispatcher writes it before it sends, see
        :meth:`~jobplane.dispatch.Dispatcher.publish`). Best effort: a row another
        transaction holds (being claimed) is skipped. With ``fence`` (the leader's lease)
        nothing is written once that term is over (:class:`~jobplane.errors.NotLeaderError`).
        """

    async def get_instance(self, instance_id: UUID) -> Instance:
        """Raises :class:`~jobplane.errors.InstanceNotFoundError`."""

    async def request_cancel(self, instance_id: UUID, actor: str) -> Instance:
        """Cancel: a Scheduled or Enqueued instance ends Cancelled at once; a Processing one
        gets ``cancel_requested`` for its worker. Raises IllegalTransitionError when terminal
        and InstanceNotFoundError when unknown."""

    async def run_now(self, instance_id: UUID, actor: str, *, published: bool = False) -> Instance:
        """Run a Scheduled instance now (held by the debug mode, or delayed): → Enqueued, due
        now, to be published by the caller; with ``published``, recorded as published in the
        same write (the caller clears the mark if its send fails). Raises
        IllegalTransitionError when it is not Scheduled and InstanceNotFoundError when
        unknown."""

    async def cancel_many(self, filter: InstanceFilter, *, limit: int, actor: str) -> BulkCancel:
        """Cancel, in one transaction, up to ``limit`` of the instances that
        ``filter.for_cancel()`` selects, oldest first: Scheduled and Enqueued ones end
        Cancelled (with history), Processing and Failed ones get ``cancel_requested``, as
        :meth:`request_cancel` does one at a time. An instance that moved on meanwhile is
        skipped, never an error."""

    async def list_instances(
        self, filter: InstanceFilter, *, limit: int = 50, before: UUID | None = None
    ) -> Page:
        """Newest first, keyset-paginated on the (time-ordered) id."""


class WorkerStore(DispatchStore, Registration, WorkerReads, Protocol):
    """The worker role: claims, heartbeats, checkpoints, outcomes, its own registration."""

    async def still_enqueued(self, ids: Collection[UUID]) -> set[UUID]:
        """Those of ``ids`` that are Enqueued (a message for any other is obsolete)."""

    async def claim(
        self, ids: Sequence[UUID], worker_id: str, lease_s: float, jobs: Collection[str]
    ) -> ClaimResult:
        """Claim the Enqueued instances among ``ids`` for ``worker_id``, in one statement.

        Only instances of ``jobs`` (the jobs this worker knows), not pinned to another worker,
        are eligible. Each claimed instance takes a fresh token from the claim sequence, a lease
        of ``lease_s`` on the store's clock, and one slot of its job: per job key, the free slots
        (max concurrency - used) go to the eligible rows by priority then age; the excess is
        Skipped (``on_limit=skip``) or left Enqueued and unpublished (``on_limit=wait``).
        An eligible instance with ``cancel_requested`` (a cancel that reached a running attempt
        which was then released) is never claimed: it ends Cancelled in the same statement.
        """

    async def heartbeat(
        self,
        leases: Collection[tuple[UUID, int]],
        lease_s: float,
        progress: Mapping[UUID, tuple[float, str | None]] | None = None,
    ) -> dict[UUID, bool]:
        """Extend the leases still held (id and token match, Processing) to ``lease_s`` from
        the store's clock, and record the latest ``progress`` of those. Returns, for each lease
        kept, whether a cancel was requested; a lease missing from the answer was lost."""

    async def save_checkpoint(self, instance_id: UUID, claim_token: int, data: Any) -> bool:
        """Persist a job's checkpoint (JSON) for its next attempt; fenced by the claim token.
        ``False`` if the attempt no longer holds the instance."""

    async def complete(self, outcomes: Sequence[Outcome]) -> dict[UUID, InstanceState]:
        """Record the end of attempts (fenced by their claim tokens); release their slots.

        A Failed attempt with retries left moves on to Scheduled (backoff > 0) or Enqueued
        (the caller publishes it), otherwise to Terminated. A cancel wins over a retry: a Failed
        outcome (exception or timeout) of an instance with ``cancel_requested`` ends Cancelled
        instead, the error kept, decided by the same conditional update. Returns the state
        each recorded instance ended in; an outcome whose token no longer matches was fenced
        off, changed nothing, and is absent from the answer.

        An outcome with ``holds_slot`` (its code still runs) keeps its job's slot, recorded as
        held by (instance id, claim token) until :meth:`release_runaway_slot`, or until the
        dead-worker sweep finds its worker stopped.
        """

    async def release_fenced(
        self, instance_id: UUID, claim_token: int, *, actor: str, reason: str
    ) -> Instance | None:
        """Release an attempt its worker stopped because it could not renew the lease in time
        (the worker's fence), counted as the reaper counts an expired lease: Processing →
        Enqueued with ``reason`` and one unexpected retry (no retry used), Terminated once the
        job's ``max_unexpected_retries`` are used up, Cancelled if a cancel is pending. Fenced by
        ``claim_token``; ``None`` (nothing written) if the attempt no longer holds it."""

    async def release_runaway_slot(self, instance_id: UUID, claim_token: int) -> bool:
        """Give back the slot an attempt kept when its outcome was recorded with
        ``holds_slot`` (its code has now returned). ``False`` if it holds none (never held,
        already released, or released by the sweep)."""

    async def republish_waiting(self, job_keys: Collection[str], limit: int) -> list[Instance]:
        """Enqueued, unpublished instances of ``job_keys`` (parked by ``on_limit=wait``),
        oldest first, marked published now: the caller hands them to the bus."""

    async def register_worker(self, info: WorkerInfo) -> None:
        """Insert or refresh a worker row; sets its heartbeat to now. Slots still held by
        runaway code under this worker id (a previous process's) are given back."""

    async def worker_heartbeat(self, worker_id: str) -> bool:
        """Stamp the worker's heartbeat; False (and nothing stamped) if it was marked stopped
        meanwhile: a worker the sweep declared dead is never silently revived."""
        ...

    async def worker_stopped(self, worker_id: str) -> None: ...

    async def transition(
        self,
        instance_id: UUID,
        to_state: InstanceState,
        *,
        expect: Collection[InstanceState],
        claim_token: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> Instance | None:
        """Move one instance to ``to_state`` if it is in one of ``expect`` (and, when given,
        still holds ``claim_token``). Leaving Processing releases the slot in the same
        statement. Returns the new instance, or ``None`` if nothing matched.
        Raises IllegalTransitionError if some state of ``expect`` cannot reach ``to_state``."""


class HeldFire(Protocol):
    """A fire written ahead of its tick, in a transaction still open (see fire_ahead)."""

    #: The instances as written (or as found: a tick recorded before).
    instances: list[Instance]

    async def commit(self, within_s: float) -> list[Instance]:
        """Commit once the database's clock reaches the tick, unless it is then more than
        ``within_s`` past it (raises, nothing recorded): the instances exist from then on.
        On another error the fire is unknown: a fire of the same records then finds what was
        recorded."""

    async def abandon(self) -> None:
        """Roll back (unless committed) and give the connection back; no-op the second time."""


class LeaderStore(DispatchStore, Protocol):
    """The scheduler role: its lease, and the leader's duties (each fenced by the leader's
    lease: :class:`~jobplane.errors.NotLeaderError` once deposed)."""

    async def acquire_leadership(self, shard: int, holder: str, ttl_s: float) -> LeaderLease | None:
        """Take the lease of ``shard`` if it is free or expired (a new term), or renew it if
        ``holder`` holds it (same term). ``None`` if someone else holds a live lease."""

    async def release_leadership(self, shard: int, holder: str, term: int) -> bool:
        """Give the lease up at once (graceful stop) if still held at ``term``."""

    async def scheduler_seen(self, shard: int, holder: str) -> None:
        """Record that replica ``holder`` campaigns for ``shard`` now (leader or standby);
        forget replicas silent for an hour."""

    async def scheduler_gone(self, shard: int, holder: str) -> None:
        """Forget replica ``holder`` (it stops cleanly)."""

    async def fire(
        self,
        lease: LeaderLease,
        new: Sequence[NewInstance],
        *,
        published: bool = False,
        planned: Mapping[str, int] | None = None,
    ) -> list[Instance]:
        """Create cron occurrences (and misfire records) as leader; a tick already recorded
        is not created again (unique job key + scheduled time). With ``published``, a store
        may record the Enqueued instances it creates as published (``published_at``) in the
        same write, as :meth:`DispatchStore.create_published` does; the caller then sends
        them (:meth:`~jobplane.dispatch.Dispatcher.publish_created`). With ``planned`` (job
        key → the definition version its ticks were planned under), nothing is created if a
        job's stored definition has another version: ``DefinitionsChangedError`` names those
        jobs. Decided in the write, so an edit committed before it is never missed."""

    async def fire_ahead(
        self,
        lease: LeaderLease,
        new: Sequence[NewInstance],
        *,
        published: bool = False,
        planned: Mapping[str, int] | None = None,
    ) -> HeldFire | None:
        """As :meth:`fire`, written now and committed by :meth:`HeldFire.commit` at the tick
        (until then nobody sees it, an edit of its jobs waits for it, and so does a takeover);
        ``None`` where the store cannot hold a write open (its fire is then made at the tick).
        Raises as :meth:`fire` does."""

    async def last_occurrences(self, keys: Collection[str]) -> dict[str, datetime]:
        """The latest recorded cron tick of each job: where the next fire is computed from."""

    async def schedule_histories(
        self, after: Mapping[str, datetime]
    ) -> dict[str, list[DefinitionVersion]]:
        """Per job key, the versions in effect after its time, oldest first (see catch_up)."""

    async def promote_due(self, lease: LeaderLease, limit: int = 1000) -> list[Instance]:
        """Scheduled instances whose ``run_at`` has come (database clock) → Enqueued."""

    async def promote_due_each(self, lease: LeaderLease, limit: int = 1000) -> list[Instance]:
        """:meth:`promote_due` one instance per transaction (after the database refused the
        batch): an instance still refused is logged and left Scheduled."""

    async def release_expired(self, lease: LeaderLease, limit: int = 1000) -> list[Instance]:
        """Expired attempt leases: → Enqueued (an unexpected retry, no retry used), →
        Terminated when unexpected retries are exhausted, → Cancelled if a cancel was pending.
        Returns the released (Enqueued) ones, to publish."""

    async def resolve_orphaned_pins(
        self, lease: LeaderLease, unaware_after_s: float | None = None
    ) -> list[tuple[Instance, str]]:
        """Instances pinned to a worker that is gone, or (with ``unaware_after_s``) waiting
        longer than that pinned to a live worker that has not registered their job: unpinned
        (returned, to publish, each with the worker it was pinned to) or Terminated, per the
        job's ``pin_fallback``."""

    async def terminate_unknown_jobs(
        self, lease: LeaderLease, after_s: float, limit: int = 1000
    ) -> list[Instance]:
        """Enqueued instances waiting longer than ``after_s`` of a job that no live worker has
        registered, nor any worker for that long: → Terminated ("no worker knows the job")."""

    async def scheduled_due_within(self, seconds: float) -> list[datetime]:
        """``run_at`` of the Scheduled instances due within ``seconds``."""

    async def leases_ending_within(self, seconds: float) -> list[datetime]:
        """The distinct ends of running attempts' leases within ``seconds``, earliest first."""

    async def unpublished(
        self, older_than_s: float, limit: int = 1000, *, after: PublishedKey | None = None
    ) -> list[Instance]:
        """Enqueued, unclaimed instances whose message may be lost: never published, then
        published longer than ``older_than_s`` ago, in (publication time, id) order; of
        those, only the ones after ``after`` (the last one of the previous page)."""

    async def unpublished_among(self, ids: Collection[UUID]) -> list[Instance]:
        """Those of ``ids`` still Enqueued and never published (announced by a notification
        from an in-transaction enqueue)."""

    def notifications(self, channel: str) -> AsyncIterator[list[str]]:
        """Batches of payloads notified on ``channel`` by committed transactions (Postgres
        ``LISTEN``; SQLite: this store's own, in this process: ``jobplane.store.sqlite``). Raises
        :class:`~jobplane.errors.StoreUnavailableError` when the listening connection is lost."""

    async def all_enqueued(self, after: UUID | None, limit: int = 1000) -> list[Instance]:
        """Every Enqueued instance in id order, a page at a time."""

    async def mark_dead_workers(
        self, silent_for_s: float, *, fence: LeaderLease | None = None
    ) -> list[str]:
        """Mark workers silent for ``silent_for_s`` as stopped; return their ids. Slots held
        by runaway code of stopped workers are given back in the same transaction. Fenced by
        the leader's lease ``fence``."""

    async def forget_stopped_workers(
        self, before: datetime, limit: int = 100, *, fence: LeaderLease | None = None
    ) -> list[WorkerInfo]:
        """Delete (and return) the rows of up to ``limit`` workers stopped before ``before``,
        but not of one still holding a runaway slot. Fenced by the leader's lease ``fence``."""

    async def delete_finished_before(
        self, before: datetime, limit: int = 1000, *, fence: LeaderLease | None = None
    ) -> int:
        """Retention: delete a batch of terminal instances (and history) finished before,
        except each recurring job's latest tick (the leader plans from it). Fenced by the
        leader's lease ``fence``."""


class ApiStore(DispatchStore, DefinitionEdits, WorkerReads, Protocol):
    """The API role (REST and the dashboard): reads, figures, the cluster's state, tokens."""

    async def recent_ends(self, job_key: str, limit: int) -> list[Instance]:
        """The ``limit`` instances of ``job_key`` that ended last, latest first (their
        ``started_at`` to ``finished_at`` is their last attempt)."""

    async def transitions(self, instance_id: UUID) -> list[Transition]:
        """History of one instance, in sequence order."""

    async def count_by_state(
        self, job_key: str | None = None, *, job_keys: Collection[str] | None = None
    ) -> dict[InstanceState, int]:
        """Number of instances in each state (states with none are absent), of every job,
        of ``job_key`` or of the jobs in ``job_keys``. Read from counters the database keeps
        in the same transaction as each change, so exact and independent of the table's
        size."""

    async def gauges(self) -> tuple[dict[tuple[str, InstanceState], int], int]:
        """Instances by (job, state) (pairs with none are absent), and how many workers have
        not stopped, in one statement. Read from the same counters as :meth:`count_by_state`
        and a partial index of the live workers: its cost does not grow with the instances
        nor with the workers that stopped."""

    async def job_summaries(
        self, keys: Collection[str] | None = None, *, window_s: float = 86400.0
    ) -> dict[str, JobSummary]:
        """How each job (or each of ``keys``) has been doing, in one grouped query: its
        latest terminal instance (by end time), the instances that ended within the last
        ``window_s`` seconds and how many succeeded, and the 95th percentile (interpolated,
        as ``percentile_cont``) of the duration, claim to end, of the attempts that ended
        within it. A job with no ended instance and no attempt may be absent."""

    async def throughput(
        self,
        width_s: int,
        count: int,
        job_key: str | None = None,
        *,
        job_keys: Collection[str] | None = None,
    ) -> list[Bucket]:
        """Ends recorded in the history (→ Succeeded, → Failed, → Terminated) in each of
        the last ``count`` buckets of ``width_s`` seconds (aligned on the epoch; the last one
        holds the store's now, so it is still filling), oldest first; empty buckets included.
        Of every job, of ``job_key``, or of the jobs in ``job_keys``."""

    async def lags(self, window_s: float = 3600.0) -> Lags:
        """The p95 fire lag (cron ticks created in the window, misfire records excluded:
        ``created_at - scheduled_at``) and p95 pickup lag (claims recorded in the window: the
        time since the instance's latest → Enqueued before it), with how many of each."""

    async def get_leader(self, shard: int) -> LeaderLease | None: ...

    async def list_schedulers(self, shard: int) -> list[SchedulerReplica]:
        """Every replica remembered for ``shard``, the most recently seen first."""

    async def running_by_worker(self) -> dict[str, int]:
        """How many Processing instances each worker holds (workers with none are absent)."""

    async def runaway_slots(self) -> list[RunawaySlot]:
        """Slots held by runaway code (an attempt whose outcome is recorded while its sync
        code runs on), the longest-held first; at most a few hundred."""

    async def create_token(
        self, name: str, role: Role, actor: str, *, expires_in: timedelta | None = None
    ) -> tuple[TokenInfo, str]:
        """A new token and its secret: the only time the secret exists outside the caller.
        With ``expires_in`` it stops working that long after now (the database's clock)."""

    async def ensure_token(
        self, secret: str, name: str, role: Role, actor: str
    ) -> tuple[TokenInfo, bool]:
        """The token with this (caller-chosen) secret, created with ``name`` and ``role`` if
        no token has it yet; ``(info, created)``. Idempotent and safe under concurrency; an
        existing token is returned as it is, even revoked."""

    async def authenticate(self, secret: str) -> TokenInfo | None:
        """The live token whose secret this is, if any (matched on its SHA-256): not revoked,
        not expired. Records its use (``last_used_at``), at most about once a minute."""

    async def list_tokens(self) -> list[TokenInfo]: ...

    async def revoke_token(self, token_id: UUID, actor: str) -> bool:
        """Revoke at once, recording ``actor`` (who revoked it); ``False`` if unknown or
        already revoked. Raises LastAdminError instead of revoking the last live admin
        token."""


class Store(WorkerStore, LeaderStore, ApiStore, Protocol):
    """Persistent state of Jobplane: every role's interface in one. Implementations own
    their engine and close it. Roles type against the narrower interfaces above."""
