"""Outcomes the database refuses (a poison item): recorded one by one, and one that is still
refused is parked as a plain failure, so the record loop — and the worker — keep going.

A refusal here is not an outage (those are :class:`~jobplane.errors.StoreUnavailableError`,
retried): it is a statement Postgres rejects for this item's data, e.g. a result or error
message holding a NUL character (``\\u0000`` cannot be stored in ``jsonb``), or a check
violation. Retrying it unchanged would fail for ever.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from uuid import UUID

from jobplane.domain.models import ErrorInfo, Outcome
from jobplane.domain.states import InstanceState
from jobplane.errors import StoreRefusedError, first_line

logger = logging.getLogger("jobplane_worker.worker")

Complete = Callable[[Sequence[Outcome]], Awaitable[dict[UUID, InstanceState]]]


async def complete_isolating_poison(
    complete: Complete,
    outcomes: Sequence[Outcome],
    on_refused: Callable[[BaseException], None] = lambda exc: None,
) -> dict[UUID, InstanceState]:
    """``complete(outcomes)``; if the database refuses the batch, each outcome on its own,
    and one still refused is recorded as a failure that says why (:func:`parked`). One that
    cannot be recorded even so is logged and left to its lease: the reaper then releases it.
    ``on_refused`` sees every refusal."""
    try:
        return await complete(outcomes)
    except StoreRefusedError as exc:
        on_refused(exc)
        if len(outcomes) > 1:
            ended: dict[UUID, InstanceState] = {}
            for outcome in outcomes:
                ended.update(await complete_isolating_poison(complete, [outcome], on_refused))
            return ended
        [outcome] = outcomes
        logger.error(
            "the outcome of instance %s was refused by the database: %s; recording a failure",
            outcome.instance_id,
            first_line(exc),
            extra={"action": "worker.outcome_refused", "instance_id": str(outcome.instance_id)},
        )
        try:
            return await complete([parked(outcome, exc)])
        except StoreRefusedError as again:
            on_refused(again)
            logger.error(
                "instance %s: not even a failure could be recorded (%s); left to its lease",
                outcome.instance_id,
                first_line(again),
                extra={"action": "worker.outcome_lost", "instance_id": str(outcome.instance_id)},
            )
            return {}


def parked(outcome: Outcome, exc: StoreRefusedError) -> Outcome:
    """``outcome`` without what the database refused: no result, an error naming the refusal.
    A success whose result cannot be stored is a failure, as a result that is not JSON is."""
    error = ErrorInfo(
        type="OutcomeNotStored",
        message=f"the outcome could not be stored: {first_line(exc)}",
    )
    state = InstanceState.FAILED if outcome.state is InstanceState.SUCCEEDED else outcome.state
    return replace(outcome, state=state, result=None, error=error)
