"""The supervised event listener (jobplane.events.listen) on the Redis bus and the in-process
bus: delivery, what it swallows and logs, what it raises, and resubscribing after an outage of
a Redis server of the test's own (never the shared one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import pytest

from jobplane.bus.abc import Bus
from jobplane.bus.envelope import Event, EventKind
from jobplane.bus.factory import open_bus
from jobplane.errors import StoreUnavailableError, UnavailableError
from jobplane.events import listen
from tests.cli_helpers import free_port
from tests.fixtures.private_servers import private_redis

ROLE = "eventtest"


class Boom(Exception):
    """A handler bug."""


class Deposed(Exception):
    """An error the caller wants to end the listener (as the scheduler's NotLeaderError)."""


def _event(n: int, kind: EventKind = EventKind.DEFINITIONS_CHANGED) -> Event:
    return Event(kind, {"n": n})


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _publish_until(bus: Bus, seen: list[int], n: int, timeout_s: float = 20) -> None:
    """Publish event ``n`` until the handler has seen it: a subscription takes a moment to be
    in place, and events published before that are not delivered. (Exercised with a handler
    that records what it sees: a repeated event is harmless there.)"""
    deadline = time.monotonic() + timeout_s
    while n not in seen:
        assert time.monotonic() < deadline, f"event {n} never reached the handler"
        with contextlib.suppress(UnavailableError):  # a pooled connection from before a restart
            await bus.publish_event(_event(n))
        await asyncio.sleep(0.05)


def _actions(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


def _subscribed(bus: Bus) -> Callable[[], bool]:
    """Whether the in-process bus has a subscriber (events published before are dropped)."""
    return lambda: bool(getattr(bus, "_subscribers", None))


async def test_events_of_the_kinds_asked_for_reach_the_handler_in_order(bus: Bus) -> None:
    seen: list[int] = []

    async def handler(event: Event) -> None:
        assert event.kind is EventKind.DEFINITIONS_CHANGED
        seen.append(int(event.data["n"]))

    kinds = {EventKind.DEFINITIONS_CHANGED}
    listener = asyncio.create_task(listen(bus, handler, role=ROLE, what="test", kinds=kinds))
    try:
        await _publish_until(bus, seen, 0)
        await bus.publish_event(_event(99, EventKind.LEADER_RESIGNED))  # not asked for
        for n in range(1, 4):
            await bus.publish_event(_event(n))
        await _until(lambda: 3 in seen, "three events")
        assert [n for n in seen if n] == [1, 2, 3]
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    assert listener.cancelled()


async def test_a_handler_error_is_logged_with_its_traceback_and_listening_goes_on(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobplane.events")
    seen: list[int] = []

    async def handler(event: Event) -> None:
        seen.append(int(event.data["n"]))
        if event.data["n"] == 1:
            raise Boom("event 1 is bad")

    listener = asyncio.create_task(listen(bus, handler, role=ROLE, what="test"))
    try:
        await _publish_until(bus, seen, 0)
        await bus.publish_event(_event(1))
        await bus.publish_event(_event(2))
        await _until(lambda: 2 in seen, "the event after the failing one")
        assert not listener.done()
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    [record] = _actions(caplog, f"{ROLE}.event_failed")
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert isinstance(record.exc_info[1], Boom)
    assert "1 in a row" in record.getMessage()


async def test_a_handler_that_keeps_failing_stops_the_listener_with_its_error(
    memory_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobplane.events")
    calls: list[int] = []

    async def handler(event: Event) -> None:
        calls.append(int(event.data["n"]))
        raise Boom(f"always ({event.data['n']})")

    listener = asyncio.create_task(listen(memory_bus, handler, role=ROLE, what="t", max_failures=3))
    await _until(_subscribed(memory_bus), "the subscription")
    for n in range(5):
        await memory_bus.publish_event(_event(n))
    with pytest.raises(Boom, match=r"always \(2\)"):
        await asyncio.wait_for(listener, 10)
    assert calls == [0, 1, 2]
    assert len(_actions(caplog, f"{ROLE}.event_failed")) == 3
    assert not _subscribed(memory_bus)()  # closed, not leaked


async def test_a_success_resets_the_count_of_failures_in_a_row(memory_bus: Bus) -> None:
    seen: list[int] = []

    async def handler(event: Event) -> None:
        seen.append(int(event.data["n"]))
        if int(event.data["n"]) % 2:
            raise Boom("odd")

    listener = asyncio.create_task(listen(memory_bus, handler, role=ROLE, what="t", max_failures=2))
    try:
        await _publish_until(memory_bus, seen, 0)
        for n in range(1, 8):
            await memory_bus.publish_event(_event(n))
        await _until(lambda: 7 in seen, "every event")
        assert not listener.done()
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def test_errors_listed_to_propagate_end_the_listener_at_once(memory_bus: Bus) -> None:
    async def handler(event: Event) -> None:
        raise Deposed

    listener = asyncio.create_task(
        listen(memory_bus, handler, role=ROLE, what="t", propagate=(Deposed,))
    )
    await _until(_subscribed(memory_bus), "the subscription")
    await memory_bus.publish_event(_event(0))
    with pytest.raises(Deposed):
        await asyncio.wait_for(listener, 10)


async def test_an_outage_met_by_the_handler_drops_that_event_with_a_warning(
    memory_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobplane.events")
    seen: list[int] = []

    async def handler(event: Event) -> None:
        seen.append(int(event.data["n"]))
        if event.data["n"] != 0:
            raise StoreUnavailableError("the store is away")

    listener = asyncio.create_task(listen(memory_bus, handler, role=ROLE, what="t", max_failures=1))
    try:
        await _publish_until(memory_bus, seen, 0)
        for n in range(1, 4):  # more than max_failures: outages are not counted as failures
            await memory_bus.publish_event(_event(n))
        await _until(lambda: 3 in seen, "every event")
        assert not listener.done()
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    dropped = _actions(caplog, f"{ROLE}.event_dropped")
    assert len(dropped) == 3 and all(r.levelno == logging.WARNING for r in dropped)
    assert "the store is away" in dropped[0].getMessage() and dropped[0].exc_info is None


async def test_a_closed_in_process_bus_ends_the_subscription_and_is_resubscribed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="jobplane.events")
    bus = open_bus("memory://")

    async def handler(event: Event) -> None:
        pass

    listener = asyncio.create_task(listen(bus, handler, role=ROLE, what="t", retry_s=0.05))
    try:
        await _until(_subscribed(bus), "the subscription")
        await bus.close()
        await _until(
            lambda: len([r for r in caplog.records if "subscription ended" in r.getMessage()]) >= 2,
            "two resubscriptions",
        )
        assert not listener.done()  # it keeps trying: the bus is never owned by the listener
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def test_the_listener_resubscribes_after_redis_goes_away_and_warns_once_per_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobplane.events")
    port = free_port()
    prefix = f"jptest-{uuid.uuid4().hex}"
    seen: list[int] = []
    bus_errors: list[UnavailableError] = []

    async def handler(event: Event) -> None:
        seen.append(int(event.data["n"]))

    with private_redis(port) as server:
        bus = open_bus(f"redis://127.0.0.1:{port}/0", prefix)
        try:
            await _until_pings(bus)
            listener = asyncio.create_task(
                listen(
                    bus, handler, role=ROLE, what="t", retry_s=0.1, on_bus_error=bus_errors.append
                )
            )
            try:
                await _publish_until(bus, seen, 0)
                server.terminate()
                server.wait(timeout=10)
                # Many failed tries while it is down, one warning for the outage.
                await _until(lambda: len(bus_errors) >= 5, "failed resubscriptions")
                assert not listener.done()
                with private_redis(port):
                    await _until_pings(bus)
                    await _publish_until(bus, seen, 1)
                    assert not listener.done()
            finally:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
        finally:
            await bus.close()
    [warning] = _actions(caplog, f"{ROLE}.events")
    assert warning.levelno == logging.WARNING and "unavailable" in warning.getMessage()
    [restored] = _actions(caplog, f"{ROLE}.events_restored")
    assert restored.levelno == logging.INFO
    assert all(isinstance(e, UnavailableError) for e in bus_errors)


async def _until_pings(bus: Bus, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await bus.ping()
            return
        except UnavailableError:
            assert time.monotonic() < deadline, "the private Redis never answered"
            await asyncio.sleep(0.05)
