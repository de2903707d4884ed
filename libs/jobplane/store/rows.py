"""Conversions between table rows and frozen domain objects (the only place that knows both)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobplane.domain.models import (
    DefinitionChange,
    DefinitionVersion,
    ErrorInfo,
    Instance,
    InstanceSource,
    JobDefinition,
    LeaderLease,
    NewInstance,
    SchedulerReplica,
    Transition,
    WorkerInfo,
)
from jobplane.domain.options import JobOptions
from jobplane.domain.states import InstanceState
from jobplane.idempotency import fingerprint_of

INSTANCE_FIELDS = tuple(Instance.__dataclass_fields__)
# By stored value: a dict lookup, where calling the enum goes through its metaclass (a 1,000-row
# fire or claim converts every row).
_STATES = {state.value: state for state in InstanceState}
_SOURCES = {source.value: source for source in InstanceSource}


def state_of(value: str) -> InstanceState:
    """The state stored as ``value``."""
    return _STATES[value]


def definition_from_row(row: Mapping[Any, Any]) -> JobDefinition:
    return JobDefinition(
        options=JobOptions.from_stored(row["options"]),
        version=row["version"],
        paused=row["paused"],
        args_schema=row["args_schema"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        updated_by=row["updated_by"],
        schedule_since=row["schedule_since"],
        app=row["app"],
    )


def version_from_row(row: Mapping[Any, Any]) -> DefinitionVersion:
    return DefinitionVersion(
        key=row["job_key"],
        version=row["version"],
        options=JobOptions.from_stored(row["options"]),
        paused=row["paused"],
        action=DefinitionChange(row["action"]),
        actor=row["actor"],
        at=row["at"],
        rolled_back_to=row["rolled_back_to"],
    )


def definition_values(options: JobOptions) -> dict[str, Any]:
    """Column values that mirror the options (kept in step on every save)."""
    return {
        "kind": options.kind.value,
        "queue": options.queue,
        "options": options.model_dump(mode="json"),
        "max_concurrency": options.max_concurrency,
    }


def instance_from_row(row: Mapping[Any, Any]) -> Instance:
    values = {name: row[name] for name in INSTANCE_FIELDS}
    values["state"] = _STATES[values["state"]]
    values["source"] = _SOURCES[values["source"]]
    if values["error"] is not None:
        values["error"] = ErrorInfo.from_json(values["error"])
    return Instance(**values)


def inserted_instance(new: NewInstance, row: Mapping[str, Any]) -> Instance:
    """The instance a creation (a batch, a fire) inserted for record ``new``: the columns the
    insert decided and the arguments as stored (``DECIDED_COLUMNS``) from ``row``, every other
    one as the record gave it and the insert wrote it (a contract test compares it with the
    stored row)."""
    return Instance(
        id=new.id,
        job_key=new.job_key,
        state=_STATES[row["state"]],
        source=new.source,
        queue=row["queue"],
        priority=row["priority"],
        args=row["args"],
        created_at=row["created_at"],
        scheduled_at=new.scheduled_at,
        run_at=row["run_at"],
        published_at=row["published_at"],
        finished_at=row["finished_at"],
        pinned_worker=new.pinned_worker,
        retry_of=new.retry_of,
        idempotency_key=new.idempotency_key,
        reason=new.skip_reason,
        idempotency_fingerprint=fingerprint_of(new),
    )


def transition_from_row(row: Mapping[Any, Any]) -> Transition:
    return Transition(
        seq=row["seq"],
        instance_id=row["instance_id"],
        from_state=InstanceState(row["from_state"]) if row["from_state"] else None,
        to_state=InstanceState(row["to_state"]),
        at=row["at"],
        actor=row["actor"],
        reason=row["reason"],
        claim_token=row["claim_token"],
    )


def worker_from_row(row: Mapping[Any, Any]) -> WorkerInfo:
    return WorkerInfo(
        id=row["id"],
        host=row["host"],
        pid=row["pid"],
        queues=tuple(row["queues"]),
        capacity=row["capacity"],
        version=row["version"],
        jobs=tuple(row["jobs"]),
        started_at=row["started_at"],
        heartbeat_at=row["heartbeat_at"],
        stopped_at=row["stopped_at"],
    )


def replica_from_row(row: Mapping[Any, Any]) -> SchedulerReplica:
    return SchedulerReplica(
        shard=row["shard"],
        holder=row["holder"],
        started_at=row["started_at"],
        seen_at=row["seen_at"],
    )


def lease_from_row(row: Mapping[Any, Any]) -> LeaderLease:
    return LeaderLease(
        shard=row["shard"],
        holder=row["holder"],
        term=row["term"],
        acquired_at=row["acquired_at"],
        expires_at=row["expires_at"],
    )
