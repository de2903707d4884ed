"""Outcomes the store cannot record (a poison item): recorded one by one, and one that still
fails is parked as a plain failure, so the record loop — and the worker — keep going.

A refusal here is not an outage (those are :class:`~jobplane.errors.UnavailableError`,
retried until the store is back, and never isolated): it is a statement Postgres rejects for
this item's data, e.g. a result or error message holding a NUL character (``\\u0000`` cannot
be stored in ``jsonb``), or a check violation. Retrying it unchanged would fail for ever.

Any other error a write raises is isolated the same way: the entrances check what they accept
(:func:`~jobplane.domain.limits.check_json`), but should an outcome still slip through that
the store cannot even encode, one bad outcome must not take the batch, the record loop and
every outcome still queued behind it down with it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from uuid import UUID

from jobplane.domain.models import ErrorInfo, Outcome
from jobplane.domain.states import InstanceState
from jobplane.errors import StoreRefusedError, UnavailableError, first_line

logger = logging.getLogger("jobplane_worker.worker")

Complete = Callable[[Sequence[Outcome]], Awaitable[dict[UUID, InstanceState]]]


async def complete_isolating_poison(
    complete: Complete,
    outcomes: Sequence[Outcome],
    on_refused: Callable[[BaseException], None] = lambda exc: None,
) -> dict[UUID, InstanceState]:
    """``complete(outcomes)``; if the batch fails (refused by the database, or any error but
    an outage), each outcome on its own, and one that still fails is recorded as a failure
    that says why (:func:`parked`). One that cannot be recorded even so is logged and left to
    its lease: the reaper then releases it. An outage (:class:`UnavailableError`) is raised:
    the data is not at fault. ``on_refused`` sees every error isolated."""
    try:
        return await complete(outcomes)
    except UnavailableError:
        raise
    except Exception as exc:
        on_refused(exc)
        if len(outcomes) > 1:
            ended: dict[UUID, InstanceState] = {}
            for outcome in outcomes:
                ended.update(await complete_isolating_poison(complete, [outcome], on_refused))
            return ended
        [outcome] = outcomes
        _log_unrecorded(outcome, exc)
        try:
            return await complete([parked(outcome, exc)])
        except UnavailableError:
            raise
        except Exception as again:
            on_refused(again)
            logger.error(
                "instance %s: not even a failure could be recorded (%s); left to its lease",
                outcome.instance_id,
                first_line(again),
                exc_info=None if isinstance(again, StoreRefusedError) else again,
                extra={"action": "worker.outcome_lost", "instance_id": str(outcome.instance_id)},
            )
            return {}


def _log_unrecorded(outcome: Outcome, exc: Exception) -> None:
    """One error line for the outcome that could not be recorded as it was."""
    about = {"instance_id": str(outcome.instance_id)}
    if isinstance(exc, StoreRefusedError):
        logger.error(
            "the outcome of instance %s was refused by the database: %s; recording a failure",
            outcome.instance_id,
            first_line(exc),
            extra={"action": "worker.outcome_refused", **about},
        )
        return
    # Not the database's answer: something on this side (the store's encoder, a bug) failed
    # on this outcome. The traceback says where; the action tells it apart from a refusal.
    logger.error(
        "the outcome of instance %s could not be recorded: %s: %s; recording a failure",
        outcome.instance_id,
        type(exc).__name__,
        first_line(exc),
        exc_info=exc,
        extra={"action": "worker.outcome_error", **about},
    )


def parked(outcome: Outcome, exc: BaseException) -> Outcome:
    """``outcome`` without what could not be stored: no result, an error naming why. A
    success whose result cannot be stored is a failure, as a result that is not JSON is."""
    error = ErrorInfo(
        type="OutcomeNotStored",
        message=f"the outcome could not be stored: {first_line(exc)}",
    )
    state = InstanceState.FAILED if outcome.state is InstanceState.SUCCEEDED else outcome.state
    return replace(outcome, state=state, result=None, error=error)
