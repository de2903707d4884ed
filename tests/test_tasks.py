"""Stopping tasks for certain, even one that swallows its cancellation, and a cancel that a
driver reports as a connection error."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobplane import tasks
from jobplane.bus.redis_calls import translated
from jobplane.errors import BusUnavailableError
from jobplane.tasks import being_cancelled, cancel_and_wait, run_together


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_AFTER_S", 0.05)
    cancels = 0

    async def stubborn() -> None:
        # As a retry loop around a read does when the read's timeout turns the cancel into an
        # ordinary timeout: the first cancellation is lost.
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise

    async def polite() -> None:
        await asyncio.sleep(3600)

    running = [asyncio.create_task(stubborn(), name="stubborn"), asyncio.create_task(polite())]
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(running), timeout=5)
    assert all(task.done() for task in running) and cancels == 2
    assert "task stubborn survived its cancellation" in caplog.text


async def test_finished_tasks_and_their_errors_are_fine() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    done = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait([done])
    assert isinstance(done.exception(), RuntimeError)


async def test_run_together_stops_children_that_swallow_their_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_AFTER_S", 0.05)
    stopped: list[str] = []

    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # lost, as a driver may lose it
            await asyncio.sleep(3600)
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.append("stubborn")

    async def failing_while_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopped.append("failing")
            raise RuntimeError("connection lost while being cancelled") from None

    group = asyncio.create_task(run_together(stubborn(), failing_while_cancelled()))
    await asyncio.sleep(0.01)
    group.cancel()
    # A cancel ends in CancelledError, not in a group of what the children raised meanwhile.
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(group, timeout=5)
    assert sorted(stopped) == ["failing", "stubborn"]


async def test_run_together_raises_a_childs_error_and_stops_the_others() -> None:
    stopped = asyncio.Event()

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("duty failed")

    async def runs() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(run_together(fails(), runs()), timeout=5)
    assert [type(e) for e in info.value.exceptions] == [ValueError]
    assert stopped.is_set()


async def test_a_cancel_reported_as_a_connection_error_stays_a_cancel() -> None:
    async def command() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            # What a driver may do when a cancel reaches it mid-read.
            raise RedisConnectionError("Connection closed by server.") from None

    async def through_the_bus() -> None:
        async with translated("events"):
            await command()

    task = asyncio.create_task(through_the_bus())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not being_cancelled()  # this task is not

    async def outage() -> None:
        async with translated("events"):
            raise RedisConnectionError("Connection refused")

    with pytest.raises(BusUnavailableError):
        await outage()
