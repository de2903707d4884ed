"""Instance states and their transition table, as data."""

from __future__ import annotations

from enum import StrEnum

from jobplane.errors import IllegalTransitionError


class InstanceState(StrEnum):
    SCHEDULED = "scheduled"
    ENQUEUED = "enqueued"
    PROCESSING = "processing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TERMINATED = "terminated"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[InstanceState] = frozenset(
    {
        InstanceState.SUCCEEDED,
        InstanceState.SKIPPED,
        InstanceState.CANCELLED,
        InstanceState.TERMINATED,
    }
)

#: A cancel ends these at once ...
QUEUED_STATES = (InstanceState.SCHEDULED, InstanceState.ENQUEUED)
#: ... and asks the worker to stop these (a Failed instance waits for its retry).
RUNNING_STATES = (InstanceState.PROCESSING, InstanceState.FAILED)
#: The states a cancel applies to.
CANCEL_STATES = (*QUEUED_STATES, *RUNNING_STATES)

#: States an instance may be created in (the ``[*] →`` edges).
INITIAL_STATES: frozenset[InstanceState] = frozenset(
    {InstanceState.SCHEDULED, InstanceState.ENQUEUED, InstanceState.SKIPPED}
)

#: Every allowed edge. Terminal states have no outgoing edge: history is never rewritten.
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.SCHEDULED: frozenset({InstanceState.ENQUEUED, InstanceState.CANCELLED}),
    InstanceState.ENQUEUED: frozenset(
        {
            InstanceState.PROCESSING,
            InstanceState.SKIPPED,
            InstanceState.CANCELLED,
            InstanceState.TERMINATED,
        }
    ),
    # Processing → Enqueued is a release (graceful stop, lost lease): it uses no retry.
    InstanceState.PROCESSING: frozenset(
        {
            InstanceState.SUCCEEDED,
            InstanceState.FAILED,
            InstanceState.CANCELLED,
            InstanceState.ENQUEUED,
            InstanceState.TERMINATED,
        }
    ),
    # Failed → Scheduled/Enqueued is a retry; → Terminated when no attempts are left.
    InstanceState.FAILED: frozenset(
        {InstanceState.SCHEDULED, InstanceState.ENQUEUED, InstanceState.TERMINATED}
    ),
    InstanceState.SUCCEEDED: frozenset(),
    InstanceState.SKIPPED: frozenset(),
    InstanceState.CANCELLED: frozenset(),
    InstanceState.TERMINATED: frozenset(),
}

#: States in which an instance holds a concurrency slot of its job.
SLOT_HOLDING_STATES: frozenset[InstanceState] = frozenset({InstanceState.PROCESSING})


def can_transition(from_state: InstanceState | None, to_state: InstanceState) -> bool:
    """Whether ``from_state → to_state`` is an edge; ``None`` means creation (``[*]``)."""
    if from_state is None:
        return to_state in INITIAL_STATES
    return to_state in TRANSITIONS[from_state]


def check_transition(from_state: InstanceState | None, to_state: InstanceState) -> None:
    """Raise :class:`IllegalTransitionError` unless ``from_state → to_state`` is allowed."""
    if not can_transition(from_state, to_state):
        raise IllegalTransitionError(from_state or "[*]", to_state)


def sources_of(to_state: InstanceState) -> frozenset[InstanceState]:
    """Every state from which ``to_state`` can be reached."""
    return frozenset(s for s, targets in TRANSITIONS.items() if to_state in targets)
