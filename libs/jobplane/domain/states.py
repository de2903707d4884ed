"""Instance states and the transition table of DESIGN.md, as data."""

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


S = InstanceState

TERMINAL_STATES: frozenset[InstanceState] = frozenset(
    {S.SUCCEEDED, S.SKIPPED, S.CANCELLED, S.TERMINATED}
)

#: States an instance may be created in (the ``[*] →`` edges).
INITIAL_STATES: frozenset[InstanceState] = frozenset({S.SCHEDULED, S.ENQUEUED, S.SKIPPED})

#: Every allowed edge. Terminal states have no outgoing edge: history is never rewritten.
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    S.SCHEDULED: frozenset({S.ENQUEUED, S.CANCELLED}),
    S.ENQUEUED: frozenset({S.PROCESSING, S.SKIPPED, S.CANCELLED, S.TERMINATED}),
    # Processing → Enqueued is a release (graceful stop, lost lease): it uses no retry.
    S.PROCESSING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.ENQUEUED, S.TERMINATED}),
    # Failed → Scheduled/Enqueued is a retry; → Terminated when no attempts are left.
    S.FAILED: frozenset({S.SCHEDULED, S.ENQUEUED, S.TERMINATED}),
    S.SUCCEEDED: frozenset(),
    S.SKIPPED: frozenset(),
    S.CANCELLED: frozenset(),
    S.TERMINATED: frozenset(),
}

#: States in which an instance holds a concurrency slot of its job.
SLOT_HOLDING_STATES: frozenset[InstanceState] = frozenset({S.PROCESSING})


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
