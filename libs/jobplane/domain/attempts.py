"""Attempts of an instance, derived from its history: each entry to Processing starts one, the
next transition out of Processing ends it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from jobplane.domain.models import ErrorInfo, Transition
from jobplane.domain.states import InstanceState


@dataclass(frozen=True, slots=True)
class Attempt:
    number: int
    worker: str  # the actor of the claim: the worker's id
    started_at: datetime
    claim_token: int | None = None
    ended_at: datetime | None = None  # None: still running
    outcome: InstanceState | None = None  # the state it ended in
    reason: str | None = None
    error: ErrorInfo | None = None


def attempts_of(transitions: Sequence[Transition], last_error: ErrorInfo | None) -> list[Attempt]:
    """The attempts in ``transitions`` (in ``seq`` order), oldest first.

    Transitions keep no error; the instance keeps the error of its latest ended attempt
    (``last_error``), which is given to that attempt unless it succeeded."""
    found: list[Attempt] = []
    for t in transitions:
        if t.to_state is InstanceState.PROCESSING:
            found.append(
                Attempt(
                    number=len(found) + 1,
                    worker=t.actor,
                    started_at=t.at,
                    claim_token=t.claim_token,
                )
            )
        elif t.from_state is InstanceState.PROCESSING and found and found[-1].ended_at is None:
            found[-1] = replace(found[-1], ended_at=t.at, outcome=t.to_state, reason=t.reason)
    ended = [n for n, a in enumerate(found) if a.ended_at is not None]
    if last_error is not None and ended and found[ended[-1]].outcome is not InstanceState.SUCCEEDED:
        found[ended[-1]] = replace(found[ended[-1]], error=last_error)
    return found
