"""Why an attempt stopped, and the reasons recorded with a state change: each text once.

A stop reason is what a job reads in ``ctx.cancellation.reason`` (the first reason its signal
got). Some are also recorded as the reason of the state change that ends the attempt: a
timeout (Failed), a cancel request (Cancelled), a worker shutdown (back to Enqueued). Both are
``StrEnum``s: a member is the text itself, stored and compared as a plain string.
"""

from __future__ import annotations

from enum import StrEnum


class StopReason(StrEnum):
    """Why a running attempt's cancellation signal was set."""

    #: The job ran past its ``timeout_s``: the attempt ends Failed with this reason.
    TIMEOUT = "timeout"
    #: An operator asked for a cancel (API, CLI, client): the attempt ends Cancelled.
    CANCEL_REQUESTED = "cancel requested"
    #: The worker could not renew the attempt's lease (lost, or fenced before it ended).
    LEASE_LOST = "lease lost"
    #: The worker is stopping: once the code stops the instance is released (Enqueued).
    SHUTDOWN = "worker shutdown"
    #: In an isolated job's child process: the worker signalled it (SIGTERM).
    SIGNALLED = "cancelled by the worker"


class EndReason(StrEnum):
    """Reasons recorded with a state change that are not a stop reason."""

    #: The job raised: the attempt ends Failed (and may be retried).
    EXCEPTION = "exception"
    #: Cancelled while Scheduled or Enqueued: no attempt ever started.
    CANCELLED_BEFORE_RUN = "cancelled before it ran"
    #: A claim found the job at its max concurrency (``on_limit="skip"``): Skipped.
    LIMIT_REACHED = "max concurrency reached"
    #: A Failed outcome of an attempt whose cancel was requested: Cancelled, not retried.
    CANCEL_WINS = "cancel requested; the failed attempt is not retried"
    #: An Enqueued instance found with ``cancel_requested`` by a claim, or an attempt its
    #: worker's fence stopped (released): Cancelled.
    CANCEL_BEFORE_CLAIM = "cancel requested; not run again"
    #: A Failed attempt with no retry left: Terminated.
    NO_ATTEMPTS_LEFT = "no attempts left"
    #: A Scheduled instance (held or delayed) run now by an operator.
    RUN_BY_HAND = "run by hand"
    #: An attempt whose lease ran out (its worker lost or cut off): released to Enqueued.
    LEASE_EXPIRED = "lease expired"
    #: A lease ran out once more than ``max_unexpected_retries`` allow: Terminated.
    EXHAUSTED = "max unexpected retries exhausted"
    #: A cancel requested of an attempt whose worker was lost: Cancelled by the sweep.
    CANCELLED_WORKER_LOST = "cancelled; its worker was lost"
    #: The worker an instance is pinned to stopped for good (``pin_fallback="fail"``).
    PIN_GONE = "pinned worker gone"
    #: The same, with ``pin_fallback="any"``: the instance goes to its queue instead.
    PIN_GONE_UNPINNED = "pinned worker gone; unpinned"
    #: The worker an instance is pinned to is live but has not registered its job, for
    #: ``JOBPLANE_UNKNOWN_JOB_TIMEOUT_S`` (``pin_fallback="fail"``) ...
    PIN_UNAWARE = "pinned worker does not run the job"
    #: ... with ``pin_fallback="any"``: the instance goes to its queue instead.
    PIN_UNAWARE_UNPINNED = "pinned worker does not run the job; unpinned"
    #: No live worker registered the job for ``JOBPLANE_UNKNOWN_JOB_TIMEOUT_S``: Terminated.
    NO_WORKER_KNOWS = "no worker knows the job"
    #: A cron tick not fired by the misfire policy: recorded Skipped.
    MISFIRE = "misfire"
