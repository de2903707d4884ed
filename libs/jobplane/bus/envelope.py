"""The versioned JSON envelope carried by every bus entry. Never pickle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from json.encoder import encode_basestring_ascii as _quoted
from typing import Any
from uuid import UUID

from jobplane.domain.frozen import quick_init
from jobplane.errors import EnvelopeError

ENVELOPE_VERSION = 1
#: Error messages quote at most this much of the entry: they go to a log line and a
#: dead-letter entry, and a malformed body can be large.
_MAX_ERROR = 300


class MessageKind(StrEnum):
    RUN = "run"  # an Enqueued instance is ready to be claimed


@quick_init  # one per message sent and per message read (see jobplane.domain.frozen)
@dataclass(frozen=True, slots=True)
class Envelope:
    """One message on a queue stream. The store, not the message, is the truth: a worker
    re-reads the instance when it claims it, so a stale or duplicate message is harmless."""

    instance_id: UUID
    job_key: str
    priority: int
    kind: MessageKind = MessageKind.RUN
    pinned_worker: str | None = None
    #: The W3C ``traceparent`` of the span that published it (when tracing is on). Optional:
    #: envelopes written before it existed decode as they did.
    trace: str | None = None

    def encode(self) -> bytes:
        """The entry's JSON, compact: written out field by field, strings quoted as
        ``json.dumps`` quotes them (ASCII, escaped), so the bytes are what ``json.dumps`` of
        the same object gives, in a third of its time (a cron tick encodes one per instance,
        1,000 of them before its messages go out)."""
        body = (
            f'{{"v":{ENVELOPE_VERSION},"kind":{_quoted(self.kind.value)},'
            f'"id":"{self.instance_id}","job":{_quoted(self.job_key)},"prio":{int(self.priority)}'
        )
        if self.pinned_worker is not None:
            body += f',"pin":{_quoted(self.pinned_worker)}'
        if self.trace is not None:
            body += f',"tp":{_quoted(self.trace)}'
        return (body + "}").encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Envelope:
        """Parse an entry; raise :class:`EnvelopeError` for anything malformed.

        Every field's type is checked exactly (``type(x) is str``: a JSON value is never a
        subclass; ``True`` is not a priority) before it is used, so a well-formed JSON body with
        a field of the wrong type is refused here, as malformed, rather than failing later
        with whatever error the code using it happens to raise."""
        try:
            body = json.loads(raw)
        except (ValueError, TypeError, RecursionError) as exc:
            # Not JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors), not text at
            # all (TypeError), or nested deeper than the parser's recursion goes.
            raise EnvelopeError(f"undecodable envelope: {exc}"[:_MAX_ERROR]) from exc
        if type(body) is not dict:
            raise EnvelopeError("undecodable envelope: not a JSON object")
        version = body.get("v")
        if version != ENVELOPE_VERSION or type(version) is not int:
            raise EnvelopeError(f"unsupported envelope version {version!r}"[:_MAX_ERROR])
        instance_id = body.get("id")
        job = body.get("job")
        priority = body.get("prio")
        kind = body.get("kind")
        pin = body.get("pin")
        trace = body.get("tp")
        if (
            type(instance_id) is not str
            or type(job) is not str
            or type(priority) is not int
            or type(kind) is not str
            or (pin is not None and type(pin) is not str)
        ):
            raise EnvelopeError(
                "undecodable envelope: fields missing or of the wrong type "
                "(id, job and kind are text, prio an integer, pin text if present)"
            )
        try:
            return cls(
                instance_id=UUID(instance_id),
                job_key=job,
                priority=priority,
                kind=MessageKind(kind),
                pinned_worker=pin,
                # A malformed trace never makes a job undeliverable: it is dropped.
                trace=trace if type(trace) is str else None,
            )
        except ValueError as exc:  # an id that is not a UUID, a kind this version lacks
            raise EnvelopeError(f"undecodable envelope: {exc}"[:_MAX_ERROR]) from exc


def undecodable(exc: Exception) -> str:
    """What a dead-letter entry and its log line say about an entry that did not decode: the
    :class:`EnvelopeError`'s message, or, for anything else a decode raised (which
    :meth:`Envelope.decode` should have turned into one), its type and message."""
    if isinstance(exc, EnvelopeError):
        return str(exc)
    return f"undecodable envelope: {type(exc).__name__}: {exc}"[:_MAX_ERROR]


class EventKind(StrEnum):
    DEFINITIONS_CHANGED = "definitions_changed"  # data: {"keys": [...]}
    CANCEL_REQUESTED = "cancel_requested"  # data: {"instance_id": ..., "worker_id": ...}
    INSTANCES_CREATED = "instances_created"  # data: {"count": n}: wakes the leader early
    LEADER_RESIGNED = "leader_resigned"  # data: {"shard": n}: followers campaign at once


@dataclass(frozen=True, slots=True)
class Event:
    """A broadcast hint. Events only make things faster; the periodic sweeps make them certain,
    so losing one is never a correctness problem."""

    kind: EventKind
    data: dict[str, Any]

    def encode(self) -> bytes:
        return json.dumps(
            {"v": ENVELOPE_VERSION, "kind": self.kind.value, "data": self.data}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Event:
        try:
            body = json.loads(raw)
            if body.get("v") != ENVELOPE_VERSION or not isinstance(body.get("data"), dict):
                raise EnvelopeError("unsupported event")
            return cls(kind=EventKind(body["kind"]), data=body["data"])
        except EnvelopeError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            # RecursionError: a body nested deeper than the parser goes.
            raise EnvelopeError(f"undecodable event: {exc}"[:_MAX_ERROR]) from exc
