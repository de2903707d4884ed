"""Stopping tasks for certain, even one that swallows its cancellation."""

from __future__ import annotations

import asyncio

import pytest

from jobplane import tasks
from jobplane.tasks import cancel_and_wait


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
