"""Jobs: list, read, edit options, pause and resume, trigger."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, status

from jobplane.cron import next_fire_times
from jobplane.definitions import announce
from jobplane.domain.models import JobDefinition, JobSummary, WorkerInfo
from jobplane.domain.options import JobKind
from jobplane.errors import InvalidOptionsError
from jobplane_api.deps import BusDep, DispatcherDep, StoreDep
from jobplane_api.inputs import IdempotencyKey
from jobplane_api.schemas import (
    INSTANCE_LINKS,
    JOB_LIST_LINKS,
    PROBLEM_RESPONSES,
    InstanceOut,
    JobOut,
    JobPatch,
    RollbackIn,
    TriggerIn,
    VersionOut,
)
from jobplane_api.security import Admin, Operator, Principal, Viewer, actor_of

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"], responses=PROBLEM_RESPONSES)

TRIGGER_EXAMPLE = {"args": {"name": "Ada"}, "delay_s": 0, "priority": 5}
ROLLBACK_EXAMPLE = {"to_version": 3, "version": 7}
PATCH_EXAMPLE = {"version": 7, "options": {"cron": "*/5 * * * *", "retries": 3}}


def runners(workers: Sequence[WorkerInfo], definition: JobDefinition) -> int:
    """How many live workers can run the job now (:meth:`WorkerInfo.runs`): while there is
    none, its instances wait."""
    return sum(1 for w in workers if w.runs(definition))


def _out_of(
    definition: JobDefinition,
    now: datetime,
    fires: int,
    summary: JobSummary | None,
    workers: Sequence[WorkerInfo],
) -> JobOut:
    """A job with its next ``fires`` fire times. One job's schedule that cannot be computed
    (a stored expression that never fires) is shown on that job, never fails the page."""
    options = definition.options
    upcoming: list[datetime] = []
    error = None
    if fires and options.cron and not definition.paused and not options.disabled:
        try:
            upcoming = next_fire_times(
                options.cron,
                options.timezone,
                now,
                fires,
                start_at=options.start_at,
                end_at=options.end_at,
            )
        except InvalidOptionsError as exc:
            error = str(exc)
    return JobOut.of(definition, upcoming, summary, error, runners(workers, definition))


async def _out(store: StoreDep, definition: JobDefinition, fires: int) -> JobOut:
    summaries = await store.job_summaries([definition.key])
    now, workers = await store.now(), await store.list_workers()
    return _out_of(definition, now, fires, summaries.get(definition.key), workers)


@router.get(
    "",
    summary="List jobs",
    response_model=list[JobOut],
    dependencies=[Viewer],
    responses=JOB_LIST_LINKS,  # type: ignore[arg-type]
)
async def list_jobs(
    store: StoreDep,
    kind: JobKind | None = None,
    queue: str | None = None,
    paused: bool | None = None,
    q: Annotated[str | None, Query(description="Text in the key, name or description.")] = None,
    app: Annotated[
        str | None, Query(description="Only the jobs registered by the App of this name.")
    ] = None,
) -> list[JobOut]:
    """Every job definition, filtered by app, kind, queue, paused state or text, with its next
    fire, its latest outcome, and its success rate and p95 attempt duration over 24 h."""
    matching = []
    needle = (q or "").lower()
    for d in await store.list_definitions(app=app):
        o = d.options
        if kind is not None and o.kind is not kind:
            continue
        if queue is not None and o.queue != queue:
            continue
        if paused is not None and d.paused != paused:
            continue
        if needle and needle not in f"{o.key} {o.name} {o.description}".lower():
            continue
        matching.append(d)
    # One grouped query for the figures of every job shown (never one query per job); the
    # jobs of one app only when the app filter narrowed the list.
    keys = [d.key for d in matching] if app is not None else None
    summaries = await store.job_summaries(keys) if matching else {}
    now = await store.now()
    workers = await store.list_workers() if matching else []
    return [_out_of(d, now, 1, summaries.get(d.key), workers) for d in matching]


@router.get("/{key}", summary="Get a job", response_model=JobOut, dependencies=[Viewer])
async def get_job(store: StoreDep, key: str) -> JobOut:
    """Options, version, argument JSON Schema, the next 10 fire times, the latest outcome
    and the last 24 hours' success rate and p95 attempt duration."""
    return await _out(store, await store.get_definition(key), 10)


@router.patch(
    "/{key}",
    summary="Edit a job's options",
    response_model=JobOut,
    openapi_extra={"requestBody": {"content": {"application/json": {"example": PATCH_EXAMPLE}}}},
)
async def edit_job(
    store: StoreDep,
    bus: BusDep,
    key: str,
    patch: JobPatch,
    principal: Annotated[Principal, Admin],
) -> JobOut:
    """Change options (validated); ``version`` must be the one you read, else 409. The edit
    applies to the next fire and the next claim, without restarting anything."""
    current = await store.get_definition(key)
    if patch.version != current.version:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job {key!r} is at version {current.version}, not {patch.version}",
        )
    options = current.options.edited(**patch.options)
    saved = await store.save_definition(
        options, expected_version=patch.version, actor=actor_of(principal)
    )
    if saved is None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {key!r} was edited meanwhile")
    await _announce(bus, saved)
    return await _out(store, saved, 10)


@router.post("/{key}/pause", summary="Pause a job", response_model=JobOut)
async def pause_job(
    store: StoreDep, bus: BusDep, key: str, principal: Annotated[Principal, Operator]
) -> JobOut:
    """A paused recurring job does not fire until resumed."""
    saved = await store.set_paused(key, True, actor_of(principal))
    await _announce(bus, saved)
    return await _out(store, saved, 10)


@router.post("/{key}/resume", summary="Resume a job", response_model=JobOut)
async def resume_job(
    store: StoreDep, bus: BusDep, key: str, principal: Annotated[Principal, Operator]
) -> JobOut:
    """The next fire follows the job's misfire policy."""
    saved = await store.set_paused(key, False, actor_of(principal))
    await _announce(bus, saved)
    return await _out(store, saved, 10)


@router.get(
    "/{key}/versions",
    summary="Version history of a job",
    response_model=list[VersionOut],
    dependencies=[Viewer],
)
async def list_versions(store: StoreDep, key: str) -> list[VersionOut]:
    """Every saved version of the job's definition, newest first: who saved it, when, why
    (register, edit, pause, resume, rollback) and the full options it had."""
    return [VersionOut.of(v) for v in await store.definition_history(key)]


@router.post(
    "/{key}/rollback",
    summary="Roll a job back to an older version",
    response_model=JobOut,
    openapi_extra={"requestBody": {"content": {"application/json": {"example": ROLLBACK_EXAMPLE}}}},
)
async def rollback_job(
    store: StoreDep,
    bus: BusDep,
    key: str,
    body: RollbackIn,
    principal: Annotated[Principal, Admin],
) -> JobOut:
    """Save a new version whose options are those of ``to_version`` (history is never
    rewritten; the paused flag is left as it is). ``version`` must be the current version,
    else 409; an unknown ``to_version`` is 404. Applies like an edit: next fire, next claim."""
    saved = await store.rollback_definition(
        key, body.to_version, expected_version=body.version, actor=actor_of(principal)
    )
    if saved is None:
        current = await store.get_definition(key)
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job {key!r} is at version {current.version}, not {body.version}",
        )
    await _announce(bus, saved)
    return await _out(store, saved, 10)


@router.post(
    "/{key}/instances",
    summary="Trigger a job",
    status_code=status.HTTP_201_CREATED,
    response_model=InstanceOut,
    responses=INSTANCE_LINKS,  # type: ignore[arg-type]
    openapi_extra={"requestBody": {"content": {"application/json": {"example": TRIGGER_EXAMPLE}}}},
)
async def trigger_job(
    dispatcher: DispatcherDep,
    key: str,
    body: TriggerIn,
    principal: Annotated[Principal, Operator],
    idempotency_key: Annotated[IdempotencyKey | None, Header()] = None,
) -> InstanceOut:
    """Create an instance with validated arguments, now or later (``run_at`` or ``delay_s``),
    optionally pinned to one worker. Replaying an ``Idempotency-Key`` with the same request
    returns the first instance; the key reused with a different request (another job,
    arguments, time, priority or pinned worker) is a 409 and creates nothing."""
    if body.run_at is not None and body.delay_s is not None:
        raise InvalidOptionsError("delay_s", "give run_at or delay_s, not both")
    instance = await dispatcher.trigger(
        key,
        body.args,
        run_at=body.run_at,
        delay=timedelta(seconds=body.delay_s) if body.delay_s is not None else None,
        priority=body.priority,
        pinned_worker=body.pinned_worker,
        idempotency_key=idempotency_key,
        actor=actor_of(principal),
    )
    return InstanceOut.of(instance)


async def _announce(bus: BusDep, saved: JobDefinition) -> None:
    await announce(bus, [saved])
