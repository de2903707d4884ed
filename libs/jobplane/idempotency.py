"""Idempotency keys: one key names one request.

A trigger with an ``Idempotency-Key`` stores a fingerprint of the request as it was made (job,
arguments, ``run_at`` or ``delay``, priority, pinned worker, source, ``retry_of``). A replay
with the same key and the same fingerprint returns the first instance; the same key with a
different fingerprint is refused with :class:`~jobplane.errors.IdempotencyConflictError`.

The fingerprint is of the request, not of the stored instance: a ``delay`` gives a different
``run_at`` at each replay, and an omitted priority resolves to the job's current default, so
comparing stored columns would refuse honest replays.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from jobplane.domain.models import Instance, NewInstance
from jobplane.errors import IdempotencyConflictError


def fingerprint(
    job_key: str,
    args: Any = None,
    *,
    run_at: datetime | None = None,
    delay: timedelta | None = None,
    priority: int | None = None,
    pinned_worker: str | None = None,
    source: str = "trigger",
    retry_of: UUID | None = None,
) -> str:
    """SHA-256 (hex) of the request in canonical JSON (sorted keys; ``run_at`` in UTC)."""
    request = {
        "job_key": job_key,
        "args": args,
        "run_at": run_at.astimezone(UTC).isoformat() if run_at is not None else None,
        "delay_s": delay.total_seconds() if delay is not None else None,
        "priority": priority,
        "pinned_worker": pinned_worker,
        "source": source,
        "retry_of": str(retry_of) if retry_of is not None else None,
    }
    try:
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except TypeError:
        # Keys of one object both numbers and text cannot be sorted: as they are stored, all
        # text (check_json refuses two that would read alike).
        request["args"] = json.loads(json.dumps(args))
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def fingerprint_of(new: NewInstance) -> str | None:
    """The fingerprint ``new`` carries, or one computed from its fields; None without a key."""
    if new.idempotency_key is None:
        return None
    if new.fingerprint is not None:
        return new.fingerprint
    return fingerprint(
        new.job_key,
        new.args,
        run_at=new.run_at,
        priority=new.priority,
        pinned_worker=new.pinned_worker,
        source=new.source.value,
        retry_of=new.retry_of,
    )


def same_request(
    existing: Instance,
    job_key: str,
    request_print: str | None,
    args: Any,
    pinned_worker: str | None,
) -> bool:
    """Whether ``existing`` (found under the same key) stands for the request for ``job_key``
    with fingerprint ``request_print``, ``args`` and ``pinned_worker``.

    Instances created before fingerprints were stored (migration 0006) have none: for them
    the stored job, arguments and pinned worker are compared (their priority and run_at may
    have been resolved from defaults or a delay)."""
    if existing.job_key != job_key:
        return False
    if existing.idempotency_fingerprint is not None:
        return existing.idempotency_fingerprint == request_print
    return existing.args == args and existing.pinned_worker == pinned_worker


def replayed(
    found: Iterable[Instance],
    key: str,
    job_key: str,
    request_print: str | None,
    args: Any,
    pinned_worker: str | None,
) -> Instance:
    """The instance among ``found`` (the store's replay candidates for ``key``) that stands
    for the request; raises IdempotencyConflictError if ``key`` was used for a different one.
    Pure: the store reads the candidates."""
    candidates = list(found)
    if not candidates or not all(
        same_request(i, job_key, request_print, args, pinned_worker) for i in candidates
    ):
        raise IdempotencyConflictError(key)
    return candidates[0]
