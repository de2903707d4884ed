"""What each move between instance states does besides changing ``state``, as data.

Every statement that moves an instance writes these side effects: the generic store derives
its UPDATE from :data:`EFFECTS`, and the hand-written Postgres claim and completion statements
are checked against it by a test that runs them. The rules the table follows:

- entering a terminal state stamps ``finished_at`` (no other state has one);
- entering Enqueued clears ``published_at``: the instance is to be published again;
- entering Processing starts an attempt (fresh claim token, worker, lease, ``started_at``,
  attempt count, progress cleared) and takes one of the job's concurrency slots;
- leaving Processing ends the lease (``lease_expires_at``) and gives the slot back (or hands
  it to the attempt's still-running code, see ``runaway_slots``);
- the history record carries the claim token of the attempt the move concerns: entering or
  leaving Processing, or leaving Failed (the failed attempt's retry or end).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from jobplane.domain.states import InstanceState, check_transition


class SlotChange(Enum):
    """What a move does to its job's concurrency slot counter (``job_slots.used``)."""

    NONE = 0
    TAKE = 1
    RETURN = -1


@dataclass(frozen=True, slots=True)
class Effects:
    """The side effects of one move; all off by default."""

    #: ``finished_at`` := now.
    sets_finished_at: bool = False
    #: ``published_at`` := NULL.
    clears_published_at: bool = False
    #: ``lease_expires_at`` := NULL.
    clears_lease: bool = False
    #: A new attempt: claim token, worker, lease, ``started_at``, ``attempt + 1``, progress
    #: and reason cleared.
    starts_attempt: bool = False
    slot: SlotChange = SlotChange.NONE
    #: The history record keeps the row's claim token (else NULL).
    records_claim_token: bool = False


_RETURN = SlotChange.RETURN

#: Every legal move (an edge of :data:`~jobplane.domain.states.TRANSITIONS`) and its effects.
EFFECTS: dict[tuple[InstanceState, InstanceState], Effects] = {
    (InstanceState.SCHEDULED, InstanceState.ENQUEUED): Effects(clears_published_at=True),
    (InstanceState.SCHEDULED, InstanceState.CANCELLED): Effects(sets_finished_at=True),
    (InstanceState.ENQUEUED, InstanceState.PROCESSING): Effects(
        starts_attempt=True, slot=SlotChange.TAKE, records_claim_token=True
    ),
    (InstanceState.ENQUEUED, InstanceState.SKIPPED): Effects(sets_finished_at=True),
    (InstanceState.ENQUEUED, InstanceState.CANCELLED): Effects(sets_finished_at=True),
    (InstanceState.ENQUEUED, InstanceState.TERMINATED): Effects(sets_finished_at=True),
    (InstanceState.PROCESSING, InstanceState.SUCCEEDED): Effects(
        sets_finished_at=True, clears_lease=True, slot=_RETURN, records_claim_token=True
    ),
    (InstanceState.PROCESSING, InstanceState.FAILED): Effects(
        clears_lease=True, slot=_RETURN, records_claim_token=True
    ),
    (InstanceState.PROCESSING, InstanceState.CANCELLED): Effects(
        sets_finished_at=True, clears_lease=True, slot=_RETURN, records_claim_token=True
    ),
    # A release (graceful stop, lost lease): published again, no retry used.
    (InstanceState.PROCESSING, InstanceState.ENQUEUED): Effects(
        clears_published_at=True, clears_lease=True, slot=_RETURN, records_claim_token=True
    ),
    (InstanceState.PROCESSING, InstanceState.TERMINATED): Effects(
        sets_finished_at=True, clears_lease=True, slot=_RETURN, records_claim_token=True
    ),
    # The failed attempt's retry (Scheduled: after a backoff) or its end.
    (InstanceState.FAILED, InstanceState.SCHEDULED): Effects(records_claim_token=True),
    (InstanceState.FAILED, InstanceState.ENQUEUED): Effects(
        clears_published_at=True, records_claim_token=True
    ),
    (InstanceState.FAILED, InstanceState.TERMINATED): Effects(
        sets_finished_at=True, records_claim_token=True
    ),
}


def effects_of(from_state: InstanceState, to_state: InstanceState) -> Effects:
    """The effects of ``from_state → to_state``; raises :class:`IllegalTransitionError` when
    that is not a legal move."""
    check_transition(from_state, to_state)
    return EFFECTS[from_state, to_state]
