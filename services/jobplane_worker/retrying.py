"""Retrying the worker's store writes while Postgres is unreachable.

Only :class:`~jobplane.errors.StoreUnavailableError` is retried. A write the store refuses
because the attempt no longer holds its claim token (lease lost) is an answer, not an error:
the caller logs it and does not retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_exponential,
)

from jobplane.errors import StoreUnavailableError

logger = logging.getLogger(__name__)

#: Writes that only speed things up (republishing parked instances) give up after this long;
#: the scheduler's sweep does the same work.
SIDE_WRITE_RETRY_S = 15.0


def retrying(
    what: str,
    deadline: Callable[[], float] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> AsyncRetrying:
    """Retry a store write with exponential backoff (0.2 s doubling, at most 5 s) while the
    store is unreachable: forever when ``deadline`` is ``None``, else as long as the next try
    would start before ``deadline()`` (a ``time.monotonic()`` value, read at each failure, so
    a lease renewed meanwhile extends it). The last error is re-raised. ``on_error`` sees the
    error of every failed try, the last one included."""
    return AsyncRetrying(
        retry=retry_if_exception_type(StoreUnavailableError),
        wait=wait_exponential(multiplier=0.2, max=5),
        stop=stop_never if deadline is None else _before(deadline),
        after=_report(on_error),
        before_sleep=_log(what),
        reraise=True,
    )


def _report(on_error: Callable[[BaseException], None] | None) -> Callable[[RetryCallState], None]:
    def report(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        if on_error is not None and error is not None:
            on_error(error)

    return report


def _before(deadline: Callable[[], float]) -> Callable[[RetryCallState], bool]:
    def stop(state: RetryCallState) -> bool:
        return time.monotonic() + state.upcoming_sleep >= deadline()

    return stop


def _log(what: str) -> Callable[[RetryCallState], None]:
    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        logger.warning(
            "%s: %s; try %d failed, retrying in %.1f s",
            what,
            error,
            state.attempt_number,
            state.upcoming_sleep,
            extra={"action": "worker.store_retry"},
        )

    return log
