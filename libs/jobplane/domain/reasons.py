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
