"""What a trigger asks for, and whether its job takes it: the request a trigger makes, its
validation against the job's definition (enabled, arguments that fit the schema), and the
message that carries an instance on the bus."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

from jobplane.bus.envelope import Envelope
from jobplane.domain.limits import check_idempotency_key
from jobplane.domain.models import Instance, InstanceSource, JobDefinition, NewInstance
from jobplane.domain.options import JobKind, check_delay, check_priority
from jobplane.errors import InvalidArgumentsError, InvalidOptionsError, JobDisabledError
from jobplane.idempotency import fingerprint

#: Validators built, by the ``id`` of their schema, each beside the schema itself: a dispatcher
#: keeps the definitions it read, so every trigger of a job hands in the same schema object,
#: and building its validator was 4 of the 9 µs a validation of a small schema took. The
#: schema is held, so its ``id`` cannot be reused by another object while it is cached; the
#: cache is checked by identity (``is``), never by equality. The oldest is dropped past the size.
_VALIDATORS: dict[int, tuple[dict[str, Any], Any]] = {}
VALIDATORS_KEPT = 256
_VALIDATORS_LOCK = threading.Lock()


def _validator(schema: dict[str, Any]) -> Any:
    """The JSON Schema (2020-12) validator of ``schema``, built once per schema object."""
    kept = _VALIDATORS.get(id(schema))
    if kept is not None and kept[0] is schema:
        return kept[1]
    # Imported at the first validation, not with the module: a worker triggers nothing at rest,
    # and jsonschema with its referencing registry is ~3 MB it would otherwise carry.
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    with _VALIDATORS_LOCK:  # (a job's thread may enqueue too: see jobplane.enqueue)
        while len(_VALIDATORS) >= VALIDATORS_KEPT:
            _VALIDATORS.pop(next(iter(_VALIDATORS)))
        _VALIDATORS[id(schema)] = (schema, validator)
    return validator


def check_request(request: NewInstance, definition: JobDefinition) -> None:
    """Raise JobDisabledError or InvalidArgumentsError unless ``definition`` takes
    ``request``."""
    if definition.options.disabled:
        raise JobDisabledError(request.job_key)
    if definition.args_schema is not None:
        validate_args(definition.args_schema, request.args)


def trigger_request(
    key: str,
    args: Any = None,
    *,
    now: datetime | None = None,
    run_at: datetime | None = None,
    delay: timedelta | None = None,
    priority: int | None = None,
    pinned_worker: str | None = None,
    idempotency_key: str | None = None,
    actor: str = "client",
) -> NewInstance:
    """The :class:`NewInstance` for a trigger: ``delay`` counts from ``now`` (the store's
    clock; required with ``delay``). With an ``idempotency_key`` the request's fingerprint
    keeps ``delay`` as given, so a replay of the same delayed trigger matches."""
    check_priority(priority)
    if idempotency_key is not None:
        # The API checks it as it reads the request; a trigger from code or from the
        # dashboard's form must not take a reserved key either (a bulk retry's ``retry-of:``
        # key taken by a trigger makes that retry refuse, as a conflict).
        check_idempotency_key(idempotency_key)
    # The fingerprint (a canonical JSON dump and a SHA-256) only when a key needs it.
    request_print: str | None = None
    if delay is not None:
        if now is None:
            raise ValueError("a delay needs the store's current time")
        if run_at is not None:
            raise InvalidOptionsError("delay_s", "give run_at or delay_s, not both")
        run_at = now + check_delay(delay)
        if idempotency_key is not None:
            request_print = fingerprint(
                key, args, delay=delay, priority=priority, pinned_worker=pinned_worker
            )
    elif idempotency_key is not None:
        request_print = fingerprint(
            key, args, run_at=run_at, priority=priority, pinned_worker=pinned_worker
        )
    return NewInstance(
        job_key=key,
        args=args,
        run_at=run_at,
        priority=priority,
        pinned_worker=pinned_worker,
        idempotency_key=idempotency_key,
        fingerprint=request_print,
        actor=actor,
    )


def retry_request(old: Instance, actor: str, idempotency_key: str | None) -> NewInstance:
    """The :class:`NewInstance` retrying ``old``: its job, arguments and priority, linked by
    ``retry_of`` (the old one's history is never rewritten)."""
    return NewInstance(
        job_key=old.job_key,
        args=old.args,
        source=InstanceSource.RETRY,
        priority=old.priority,
        retry_of=old.id,
        idempotency_key=idempotency_key,
        actor=actor,
    )


def retriable(old: Instance, definition: JobDefinition | None) -> bool:
    """Whether a bulk retry takes ``old``: terminal, its job known and enabled, and its
    arguments still valid for the job."""
    if not old.state.is_terminal or definition is None or definition.options.disabled:
        return False
    if definition.args_schema is not None:
        try:
            validate_args(definition.args_schema, old.args)
        except InvalidArgumentsError:
            return False
    return True


def held_in_debug(request: NewInstance, definition: JobDefinition | None) -> bool:
    """Whether the hold debug mode holds ``request``: a trigger of a triggered job. Cron
    occurrences have their own debug mode; a hand trigger of a recurring job, and retries,
    are already runs by hand."""
    return (
        request.source is InstanceSource.TRIGGER
        and definition is not None
        and definition.options.kind is JobKind.TRIGGERED
    )


def envelope_for(instance: Instance, trace: str | None = None) -> Envelope:
    return Envelope(
        instance_id=instance.id,
        job_key=instance.job_key,
        priority=instance.priority,
        pinned_worker=instance.pinned_worker,
        trace=trace,
    )


def validate_args(schema: dict[str, Any], args: Any) -> None:
    """Raise :class:`InvalidArgumentsError` naming the JSON path of the first bad field."""
    errors = list(_validator(schema).iter_errors(args if args is not None else {}))
    if errors:
        # Imported with the validator (see _validator); only a refusal needs best_match.
        import jsonschema

        error = jsonschema.exceptions.best_match(errors)
        assert error is not None  # (best_match returns None only for no errors)
        path = ".".join(str(p) for p in error.absolute_path)
        raise InvalidArgumentsError(f"args.{path}" if path else "args", error.message)
