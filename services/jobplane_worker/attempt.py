"""Running one attempt of a job: call the function, turn what happened into an Outcome."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from uuid import UUID

from opentelemetry.context import Context
from pydantic import BaseModel

from jobplane.app import JobSpec, Resources
from jobplane.context import CheckpointNotSavedError, JobContext
from jobplane.domain.limits import MAX_RESULT_BYTES, check_json
from jobplane.domain.models import Claim, ErrorInfo, Outcome
from jobplane.domain.options import Isolation
from jobplane.domain.reasons import EndReason, StopReason
from jobplane.domain.states import InstanceState
from jobplane_worker.isolation import ChildFailedError, LeaseWindow, run_in_child
from jobplane_worker.job_errors import (
    MESSAGE_MAX,
    TRACEBACK_MAX,
    TYPE_MAX,
    exception_message,
    exception_traceback,
    storable_text,
)

logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    """A claimed instance being run by this worker."""

    claim: Claim
    ctx: JobContext
    task: asyncio.Task[Outcome | None] | None = None
    lease_lost: bool = False
    #: Stopped by the worker's fence before a lease it could not renew ended (or its code ended
    #: on ``CheckpointNotSavedError``, the fence's notice); unlike a lost lease, what it leaves
    #: is still written, fenced by its token: a release once its code has stopped (see
    #: :func:`ending`).
    fenced: bool = False
    released: bool = False
    #: Set by the outcome recorder once this attempt's outcome was written (or refused).
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: A sync job's code, running in a pool thread, or an async job's task once it ignored
    #: its cancellation at its timeout (a runaway); ``None`` otherwise.
    code: asyncio.Future[Any] | None = None
    #: The worker is stopping: once the code stops, the instance is released, not recorded
    #: (unless it timed out meanwhile).
    shutdown: bool = False
    #: The claim's span (tracing on): the run and the record are its children.
    trace: Context | None = None
    #: (fence time, lease held until) as the worker's lease keeping knows them now, or
    #: ``None``: an isolated child stops itself by them (see ``isolation``).
    lease_window: LeaseWindow | None = None

    @property
    def lease(self) -> tuple[UUID, int]:
        """(instance id, claim token): this attempt, and no other of the same instance."""
        return (self.claim.instance.id, self.claim.token)

    @property
    def code_running(self) -> bool:
        """This attempt's code still runs and cannot be stopped: a pool thread, or an async
        job that swallows its cancellation."""
        return self.code is not None and not self.code.done()


class Ending(Enum):
    """What the worker writes once an attempt has ended (see :func:`ending`)."""

    #: Its outcome, fenced by its claim token.
    RECORD = "record"
    #: Processing → Enqueued, no retry used: the worker stopped it (shutdown, the fence; the
    #: fence's release counts an unexpected retry, see ``Recorder.release``).
    RELEASE = "release"
    #: Nothing: the lease was lost, another attempt may run the instance.
    LOST = "lost"
    #: Nothing: the worker failed to end it (logged); its lease runs out.
    ERROR = "error"
    #: Nothing: stopped from outside while its sync code still runs, which is never released.
    LEFT = "left"


def ending(attempt: Attempt, outcome: Outcome | None, broken: bool) -> Ending:
    """What to write for an attempt that ended with ``outcome`` (``None``: the worker stopped
    it), or ``broken`` (the worker failed to end it). A runaway (its sync code still runs) with
    an outcome always has it recorded, holding its job's slot: never released while its code
    runs, and never left holding a slot that no outcome keeps."""
    if attempt.lease_lost:
        return Ending.LOST  # every write of its token would be refused anyway
    if broken:
        return Ending.ERROR
    if outcome is None:
        return Ending.LEFT if attempt.code_running else Ending.RELEASE
    if attempt.code_running or outcome.reason == StopReason.TIMEOUT:
        return Ending.RECORD  # a runaway's outcome (a timeout), or a timeout: kept as such
    if attempt.fenced and outcome.reason != StopReason.CANCEL_REQUESTED:
        # The fence stopped it and its code has stopped: what it returned or raised is the
        # stop's doing (a job that checks ctx.cancelled returns a partial result early, or
        # raises), not its outcome. Recorded, a partial result was a success and a raise a
        # failure using a retry (Terminated with none left). Released, and run again. (Code
        # that ended just as the fence came cannot be told apart: it runs again too.) A
        # cancel requested keeps its meaning: Cancelled.
        return Ending.RELEASE
    if attempt.shutdown:
        # The worker is stopping and the code has stopped (it noticed the signal and
        # returned): another worker runs it again.
        return Ending.RELEASE
    return Ending.RECORD


async def run_attempt(
    attempt: Attempt,
    spec: JobSpec,
    resources: Resources,
    pool: Executor,
    grace_s: float,
) -> Outcome:
    """Run the job function once and describe the end of the attempt.

    Async jobs run on the event loop under the job's timeout; sync jobs run in ``pool``;
    isolated jobs in a child process. On timeout the job's cancellation is signalled, and
    ``grace_s`` later the attempt ends Failed (reason "timeout") whatever the code does. A sync
    job still running then ignores the signal: its thread cannot be stopped, so the outcome is
    returned while ``attempt.code_running`` — the caller keeps the thread's slots until it
    returns (a runaway).

    Whatever the job's code raises is its outcome (Failed, retried as its options say), even a
    ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, a library's own): nothing it does
    escapes into the worker. Only a stop the worker asked for (``ctx.cancellation`` set: its
    shutdown, a lost lease) raises ``asyncio.CancelledError``: the attempt is released, not
    failed. So does ``CheckpointNotSavedError`` escaping the job: the store stayed unreachable
    until just before the fence (the attempt is marked fenced).
    """
    claim, ctx = attempt.claim, attempt.ctx
    timeout = claim.options.timeout_s
    task = asyncio.current_task()
    try:
        if claim.options.isolation is Isolation.PROCESS:
            result = await run_in_child(
                spec, ctx, claim.instance.args, timeout, grace_s, attempt.lease_window
            )
        elif spec.is_async:
            kwargs = spec.bind(ctx, claim.instance.args, resources)
            result = await _run_async(spec, kwargs, timeout, grace_s, attempt)
        else:
            kwargs = spec.bind(ctx, claim.instance.args, resources)
            result = await _run_sync(spec, kwargs, timeout, attempt, pool, grace_s)
        if ctx.cancellation.cancel_requested:
            return _cancelled(claim)  # the job noticed the cancel and returned early
        return _succeeded(claim, result)
    except GeneratorExit as exc:
        if not _stepped_by(task):
            raise  # this coroutine is being closed (its task destroyed with its loop)
        # Raised by the job's code, in a step of this attempt's task: its outcome, as any
        # exception's. (Re-raised as a close, it escaped the worker: nothing was recorded, the
        # lease ran out and the code ran again until the unexpected retries were spent.)
        return _raised(attempt, exc)
    except BaseException as exc:
        # Whatever the job raised, SystemExit and KeyboardInterrupt included (asyncio would
        # re-raise those out of the event loop and end the worker's process).
        return _raised(attempt, exc)


def _stepped_by(task: asyncio.Task[Any] | None) -> bool:
    """Whether the code running now is a step of ``task`` on a running loop: not a close of
    its coroutine from outside (a pending task destroyed with its loop is closed by the
    garbage collector, outside any step of it)."""
    try:
        return task is not None and asyncio.current_task() is task
    except RuntimeError:  # no running loop
        return False


def _raised(attempt: Attempt, exc: BaseException) -> Outcome:
    """The outcome of an attempt whose code raised ``exc``; re-raises a stop the worker asked
    for (the attempt is released, not failed)."""
    claim, cancellation = attempt.claim, attempt.ctx.cancellation
    if cancellation.cancel_requested:
        return _cancelled(claim)  # (a cancel during a timeout's grace too: no retry)
    if isinstance(exc, TimeoutError) and cancellation.reason is StopReason.TIMEOUT:
        timeout = claim.options.timeout_s
        return _failed(
            claim, TimeoutError(f"timed out after {timeout:g} s"), reason=StopReason.TIMEOUT
        )
    if isinstance(exc, CheckpointNotSavedError) and cancellation.reason is not StopReason.TIMEOUT:
        # The store stayed unreachable until just before the fence (the checkpoint's retries
        # end FENCE_NOTICE_S before it): the fence's stop, come early, as the job's code heard
        # it. Recorded as the job's failure, an outage a little longer than the lease used a
        # retry, or Terminated a checkpointing job with none left. Released as the fence
        # releases an attempt (the fence itself would stop it a moment later).
        attempt.fenced = True
        cancellation.set(StopReason.LEASE_LOST)
        logger.warning(
            "instance %s (%s) stopped on a checkpoint not saved before its lease could end; "
            "released",
            claim.instance.id,
            claim.instance.job_key,
            extra={
                "action": "worker.fenced",
                "instance_id": str(claim.instance.id),
                "job_key": claim.instance.job_key,
            },
        )
        raise asyncio.CancelledError from exc
    if isinstance(exc, asyncio.CancelledError) and cancellation.is_set():
        # The worker asked it to stop: every stop of the worker's (its drain, a cancel
        # request, a lost lease or the fence; a timeout is a TimeoutError here) sets the signal
        # before it cancels anything. Released, not failed. A stop for the lease (an isolated
        # child that stopped itself at the fence while this worker was frozen, or its loop
        # blocked) is the fence's: its release counts an unexpected retry (uncounted, it was
        # labelled a shutdown). A lease found lost writes nothing anyway (see ``ending``).
        if cancellation.reason is StopReason.LEASE_LOST:
            attempt.fenced = True
        raise exc
    # The job's own: a TimeoutError of a call of its (the attempt's timeout always sets the
    # signal first), a CancelledError nobody asked for (a future something else cancelled; a
    # sync job's .result() of a cancelled concurrent future: taken for a stop, it was released
    # and run again, for ever), anything else. Its failure, retried as its options say.
    return _failed(claim, exc)


#: How long an async job gets to end once its task is cancelled at its timeout's grace
#: (cleanup it awaits on the way out); after that it is a runaway, left running.
ASYNC_STOP_S = 1.0


async def _run_async(
    spec: JobSpec,
    kwargs: dict[str, Any],
    timeout_s: float,
    grace_s: float,
    attempt: Attempt,
) -> Any:
    """Run the job in a task of its own and wait for it. Timeout, two phases: the
    cancellation signal is set, and ``grace_s`` later the job's task is cancelled; if it has
    not ended ``ASYNC_STOP_S`` after that (its code swallows the cancellation and goes on),
    the attempt ends on TimeoutError anyway and the task is left to run as a runaway
    (``attempt.code``), as a sync job's thread is. Awaited in this task, it ran on until its
    code returned, however long after its timeout: its instance stayed Processing and its
    slot held, and nothing said why. A cancel request or a stop of the worker's cancels this
    task, and so the job's (asyncio cancellation is itself cooperative: a job that swallows
    one of those is waited for, as before)."""
    ctx = attempt.ctx
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    code = loop.create_task(_contained(spec.func(**kwargs)))
    # What this task waits on: resolved when the job's task ends, or when it is given up as
    # a runaway. (Not ``await code``: a job that swallows its cancellation would hold this
    # task too. Not ``asyncio.wait``: twice the cost, for every attempt.)
    waiting: list[asyncio.Future[None]] = [loop.create_future()]
    code.add_done_callback(lambda _: _resolve(waiting[-1]))
    timers: list[asyncio.TimerHandle] = []
    returned = False

    def stop_code() -> None:
        code.cancel()
        timers.append(loop.call_later(ASYNC_STOP_S, lambda: _resolve(waiting[-1])))

    def on_signal() -> None:
        if returned:
            # The signal came after the code returned (a Cancellation keeps its callbacks): a
            # heartbeat sent before it returned answers "cancel requested" or "lease lost" while
            # this task records the outcome. Cancelled there, the outcome would be dropped and
            # the instance left to the reaper.
            return
        if ctx.cancellation.reason == StopReason.TIMEOUT:
            timers.append(loop.call_later(grace_s, stop_code))
        else:
            task.cancel()

    ctx.cancellation.on_set(on_signal)
    timers.append(loop.call_later(timeout_s, ctx.cancellation.set, StopReason.TIMEOUT))
    stopped: asyncio.CancelledError | None = None
    try:
        while not code.done():
            try:
                await waiting[-1]
            except asyncio.CancelledError as exc:
                # A stop of the worker's (it set the signal first): passed on to the job,
                # whose own handling of it is waited for (the cancel took the waiter).
                stopped = exc
                code.cancel()
                waiting.append(loop.create_future())
                continue
            break  # the job's task ended, or was given up
    finally:
        returned = True
        for timer in timers:
            timer.cancel()
    if not code.done():
        attempt.code = code  # it ignores its cancellation: a runaway, left running
        _report_runaway(ctx, timeout_s + grace_s + ASYNC_STOP_S)
        raise TimeoutError
    if stopped is not None and ctx.cancellation.reason == StopReason.TIMEOUT:
        # A stop during the timeout's grace (the drain cancels this task): the attempt still
        # timed out, and is recorded so (see ``_ended_as``); the stop's cancel is absorbed.
        task.uncancel()
    return _ended_as(code, stopped, ctx)


def _ended_as(
    code: asyncio.Task[tuple[bool, Any]], stopped: asyncio.CancelledError | None, ctx: JobContext
) -> Any:
    """What an async job's task that ended returned, or raises what ends its attempt. Once
    its timeout has signalled, any cancellation is the timeout's: its task cancelled at the
    grace, a stop of the worker's during the grace (the drain), or a CancelledError of the
    job's own (it cancelled what it awaited, on the signal). Taken for a stop of the
    worker's, such an attempt was released, timed out again, and again, for ever."""
    timed_out = ctx.cancellation.reason == StopReason.TIMEOUT
    if code.cancelled():
        if timed_out:
            raise TimeoutError
        if stopped is not None:
            raise stopped
        raise asyncio.CancelledError  # cancelled by the job's own code: its failure
    ended, value = code.result()
    if not ended:
        if timed_out and isinstance(value, asyncio.CancelledError):
            raise TimeoutError from value
        raise value  # what the job raised (a BaseException too), as if awaited here
    if timed_out:
        raise TimeoutError  # it noticed the signal and returned: the attempt still timed out
    return value


async def _contained(job: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """(True, what the job returned) or (False, what it raised): anything but its task's
    cancellation. Raised in a task of its own, ``SystemExit`` and ``KeyboardInterrupt`` would
    go out of the event loop and end the worker's process."""
    task = asyncio.current_task()
    try:
        return True, await job
    except asyncio.CancelledError as exc:
        if task is not None and task.cancelling():
            raise  # this task's cancellation (a stop, or the timeout's)
        return False, exc  # the job's own (a future something else cancelled): its failure
    except GeneratorExit as exc:
        if not _stepped_by(task):
            raise  # this coroutine is being closed (its task destroyed with its loop)
        return False, exc
    except BaseException as exc:  # the job's outcome, whatever it is
        return False, exc


def raised_by(code: asyncio.Future[Any]) -> BaseException | None:
    """What a job's code that ended raised (None: it returned): a pool thread's future, or an
    async job's task, whose result holds it (see :func:`_contained`)."""
    exc = code.exception()
    if exc is None and isinstance(code, asyncio.Task):
        ended, value = code.result()
        return None if ended else value
    return exc


def _resolve(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


async def _run_sync(
    spec: JobSpec,
    kwargs: dict[str, Any],
    timeout_s: float,
    attempt: Attempt,
    pool: Executor,
    grace_s: float,
) -> Any:
    """Run the job in a pool thread. Timeout, two phases: the cancellation signal is set, and
    ``grace_s`` later TimeoutError is raised whether or not the thread returned. The thread is
    never waited for beyond that: ``attempt.code`` tells the caller it still runs."""
    loop = asyncio.get_running_loop()
    thread = pool.submit(functools.partial(spec.func, **kwargs))
    attempt.code = future = asyncio.wrap_future(thread, loop=loop)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        if future.done():
            raise  # the job's own TimeoutError: its code has ended, this is no timeout of ours
        attempt.ctx.cancellation.set(StopReason.TIMEOUT)
        await asyncio.wait({future}, timeout=grace_s)  # a cooperative job returns by now
        if not future.done():
            _report_runaway(attempt.ctx, timeout_s + grace_s)
        raise


def _report_runaway(ctx: JobContext, after_s: float) -> None:
    logger.warning(
        "job %s (%s) ignores its timeout: recorded failed after %g s; it keeps its "
        "concurrency slot (and a sync job its thread) until its code returns",
        ctx.job_key,
        ctx.instance_id,
        after_s,
        extra={
            "action": "worker.runaway",
            "instance_id": str(ctx.instance_id),
            "job_key": ctx.job_key,
        },
    )


def _cancelled(claim: Claim) -> Outcome:
    return Outcome(
        claim.instance.id, claim.token, InstanceState.CANCELLED, reason=StopReason.CANCEL_REQUESTED
    )


def _succeeded(claim: Claim, result: Any) -> Outcome:
    try:
        if isinstance(result, BaseModel):
            result = result.model_dump(mode="json")  # the job's serialisers run here
        # Nothing stored that cannot be read back: depth, NaN and NUL checked as for args.
        check_json(result, "result", max_bytes=MAX_RESULT_BYTES)
    except Exception as exc:  # the job's data: whatever makes it unstorable fails the attempt
        message = exception_message(exc)
        return _failed(claim, TypeError(f"job result is not JSON serialisable: {message}"))
    return Outcome(claim.instance.id, claim.token, InstanceState.SUCCEEDED, result=result)


def _failed(claim: Claim, exc: BaseException, reason: StopReason | None = None) -> Outcome:
    retry_number = claim.instance.retries_used + 1
    delay = claim.options.backoff.delay_for(retry_number, random.random())
    if isinstance(exc, ChildFailedError):
        error = ErrorInfo(type=exc.type_name, message=str(exc), traceback=exc.child_traceback)
    else:
        # The job's exception: its __str__ may raise, its traceback may not format.
        error = ErrorInfo(
            type=type(exc).__name__,
            message=exception_message(exc),
            traceback=exception_traceback(exc),
        )
    # The job's text, as the store can keep it (NUL, lone surrogates: see storable_text).
    error = ErrorInfo(
        type=storable_text(error.type, TYPE_MAX),
        message=storable_text(error.message, MESSAGE_MAX),
        traceback=None
        if error.traceback is None
        else storable_text(error.traceback, TRACEBACK_MAX),
    )
    return Outcome(
        claim.instance.id,
        claim.token,
        InstanceState.FAILED,
        error=error,
        reason=reason or EndReason.EXCEPTION,
        retry_delay_s=delay,
    )
