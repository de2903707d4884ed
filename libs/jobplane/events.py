"""Listening to the bus's broadcast events for as long as a role runs.

Every role that reacts to events (a worker to cancel requests; a scheduler to resignations
and definition edits) runs :func:`listen`: subscribe, hand each event to a handler, subscribe
again when the subscription breaks. Events are only ever a fast path — each has a backstop
(the heartbeat, the leader lease, the sweep's version check) — so an event missed while the
listener resubscribes is handled late, not lost.

What is swallowed, and what propagates:

- The bus is unavailable (:class:`~jobplane.errors.UnavailableError` while subscribing or
  reading): swallowed. A warning with the error at the first failure of an outage, again at
  most every :data:`WARN_EVERY_S` while it lasts, and an info line with the first event
  delivered after it; the listener resubscribes every ``retry_s``.
- The subscription ends (the bus was closed): resubscribed every ``retry_s`` (debug line).
- The handler raises an ``UnavailableError`` (the store is away while it acts): a warning;
  that event is dropped (its backstop catches up) and the listener goes on.
- The handler raises one of ``propagate`` (e.g. the scheduler's ``NotLeaderError``): re-raised
  at once.
- The handler raises anything else (a bug, an event it cannot use): logged with its traceback,
  and the listener goes on; after ``max_failures`` such errors in a row (no event handled in
  between) the last one is re-raised, so the role's supervisor stops the process instead of
  leaving it half alive with a handler that always fails.
- Any other error of the bus itself (a bug), and cancellation, propagate at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from typing import NoReturn

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.errors import UnavailableError

logger = logging.getLogger(__name__)

#: While the bus stays unavailable, its warning is repeated at most this often.
WARN_EVERY_S = 60.0
#: Handler errors in a row (no event handled in between) after which the listener stops.
MAX_HANDLER_FAILURES = 5

Handler = Callable[[Event], Awaitable[None]]


class Outage:
    """The rate limit of a listener's warnings about its source (the bus, or the database
    for Postgres notifications): one line per outage, repeated while it lasts, and a line
    when it ends."""

    def __init__(self, role: str, what: str, source: str = "the bus") -> None:
        self.role, self.what, self.source = role, what, source
        self.since: float | None = None
        self.failures = 0
        self.warned_at = 0.0

    def failed(self, exc: UnavailableError, retry_s: float) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.since is None:
            self.since = self.warned_at = now
        elif now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
        else:
            return
        logger.warning(
            "%s: %s is unavailable (%s); resubscribing every %g s (%d failed tries, %.0f s)",
            self.what,
            self.source,
            exc,
            retry_s,
            self.failures,
            now - self.since,
            extra={"action": f"{self.role}.events"},
        )

    def delivered(self) -> None:
        if self.since is None:
            return
        logger.info(
            "%s: events flow again after %.0f s (%d failed tries)",
            self.what,
            time.monotonic() - self.since,
            self.failures,
            extra={"action": f"{self.role}.events_restored"},
        )
        self.since, self.failures = None, 0


async def listen(
    bus: Bus,
    handler: Handler,
    *,
    role: str,
    what: str,
    kinds: Collection[EventKind] | None = None,
    propagate: tuple[type[Exception], ...] = (),
    on_bus_error: Callable[[UnavailableError], None] | None = None,
    retry_s: float = 1.0,
    max_failures: int = MAX_HANDLER_FAILURES,
) -> NoReturn:
    """Hand every event of ``bus`` (of ``kinds``, or all) to ``handler``, one at a time, until
    cancelled; see the module docstring for the errors it swallows and those it raises.

    ``role`` prefixes the log lines' ``action`` (``worker.events``, ``scheduler.event_failed``);
    ``what`` names the listener in their text. ``on_bus_error`` sees every bus failure (e.g.
    to count it). Does not own the bus."""
    outage = Outage(role, what)
    failures = 0
    while True:
        subscription = bus.subscribe()
        try:
            async for event in subscription:
                outage.delivered()
                if kinds is not None and event.kind not in kinds:
                    continue
                failures = await _handle(
                    handler, event, role, what, propagate, failures, max_failures
                )
        except UnavailableError as exc:
            if on_bus_error is not None:
                on_bus_error(exc)
            outage.failed(exc, retry_s)
        else:
            logger.debug("%s: the subscription ended; resubscribing", what)
        finally:
            # A handler error that propagates leaves the subscription suspended: close it now
            # (Redis: its connection) rather than when it is collected. Closing it while the
            # bus is away may fail too; that must not replace what is propagating (a
            # scheduler's NotLeaderError would look like a crash).
            if isinstance(subscription, AsyncGenerator):
                await _close(subscription, what)
        await asyncio.sleep(retry_s)


async def _close(subscription: AsyncGenerator[Event, None], what: str) -> None:
    try:
        await subscription.aclose()
    except Exception as exc:  # cleanup: logged, never raised over what propagates
        logger.warning(
            "%s: could not close the subscription: %s",
            what,
            exc,
            exc_info=not isinstance(exc, UnavailableError),
            extra={"action": "events.close_failed"},
        )


async def _handle(
    handler: Handler,
    event: Event,
    role: str,
    what: str,
    propagate: tuple[type[Exception], ...],
    failures: int,
    max_failures: int,
) -> int:
    """Run the handler on one event; returns the count of handler errors in a row (the
    ``max_failures``-th is raised)."""
    try:
        await handler(event)
    except propagate:
        raise
    except UnavailableError as exc:
        logger.warning(
            "%s: %s event dropped, its backstop will catch up: %s",
            what,
            event.kind.value,
            exc,
            extra={"action": f"{role}.event_dropped"},
        )
        return failures
    except Exception:
        logger.exception(
            "%s: the handler of a %s event failed (%d in a row; the listener stops at %d)",
            what,
            event.kind.value,
            failures + 1,
            max_failures,
            extra={"action": f"{role}.event_failed"},
        )
        if failures + 1 >= max_failures:
            raise  # as it is: the role's supervisor stops the process on it
        return failures + 1
    return 0
