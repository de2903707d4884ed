"""The worker while Postgres or Redis refuses a write it makes other than the final outcome:
an ack after the claim, a checkpoint, a heartbeat carrying progress, a republish after an
outcome, a release at shutdown. Real Postgres and Redis; the outage is injected into the one
call under test (see FlakyStore and FlakyAckBus), or is a restart the driver really meets (a
TcpProxy taken down and up)."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
from sqlalchemy.engine import make_url

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.context import CheckpointNotSavedError
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.factory import open_store
from jobplane.store.sql import SqlStore
from tests.fixtures.proxy import TcpProxy
from tests.scheduler_helpers import running_scheduler
from tests.worker_helpers import FlakyAckBus, FlakyStore, running_worker, settled, wait_for

pytestmark = pytest.mark.timeout(60)


async def _streams_empty(bus: Bus) -> bool:
    return not any((await bus.stream_lengths("default")).values())


async def test_a_failed_ack_does_not_hold_back_the_claimed_instances(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("acks")

    @app.triggered(max_concurrency=10)
    async def quick(ctx: JobContext) -> int:
        return ctx.attempt

    flaky = FlakyAckBus(redis_bus, ack_failures=1)
    async with running_worker(app, pg_store, flaky):
        made = [await Dispatcher(pg_store, redis_bus).trigger("quick") for _ in range(3)]
        done = await settled(pg_store, [i.id for i in made], timeout_s=15)
        # The ack is retried: no entry is left in the streams.
        await wait_for(lambda: _streams_empty(redis_bus), timeout_s=15, what="the acks")
    assert flaky.acks_refused == 1
    assert {i.state for i in done} == {S.SUCCEEDED}
    # Started at once: never released by the reaper, no retry of any kind used.
    assert {(i.attempt, i.retries_used, i.unexpected_retries_used) for i in done} == {(1, 0, 0)}


async def test_a_checkpoint_is_retried_through_a_store_outage(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("checkpoints")

    @app.triggered(retries=2, backoff={"kind": "none"})
    async def saves(ctx: JobContext) -> int:
        await ctx.checkpoint({"page": 7})
        return ctx.attempt

    flaky = FlakyStore(pg_store)
    flaky.fail_next["save_checkpoint"] = 2
    async with running_worker(app, flaky, redis_bus):
        instance = await Dispatcher(pg_store, redis_bus).trigger("saves")
        [done] = await settled(pg_store, [instance.id])
    assert len(flaky.refusals("save_checkpoint")) == 2
    assert done.state is S.SUCCEEDED and done.result == 1 and done.retries_used == 0
    assert done.checkpoint == {"page": 7}
    assert S.FAILED not in [t.to_state for t in await pg_store.transitions(done.id)]


async def test_a_checkpoint_gives_up_clearly_once_the_lease_may_have_expired(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("checkpoints")
    lease_s = 1.5

    @app.triggered()
    async def saves(ctx: JobContext) -> dict[str, object]:
        started = time.monotonic()
        try:
            await ctx.checkpoint({"page": 1})
        except CheckpointNotSavedError as exc:
            return {"error": str(exc), "after_s": time.monotonic() - started}
        return {"error": None}

    flaky = FlakyStore(pg_store)
    flaky.down = {"save_checkpoint", "heartbeat"}  # Postgres away: the lease is not renewed
    async with running_worker(app, flaky, redis_bus, lease_s=lease_s):
        instance = await Dispatcher(pg_store, redis_bus).trigger("saves")
        [done] = await settled(pg_store, [instance.id])
    assert done.state is S.SUCCEEDED and isinstance(done.result, dict)
    assert "checkpoint not saved" in str(done.result["error"])
    assert len(flaky.refusals("save_checkpoint")) >= 2
    assert float(done.result["after_s"]) < lease_s  # it stopped trying within the lease
    assert done.checkpoint is None


async def test_progress_survives_a_failed_heartbeat(pg_store: SqlStore, redis_bus: Bus) -> None:
    app = App("progress")

    @app.triggered()
    async def reports(ctx: JobContext) -> None:
        ctx.progress(0.5, "half")
        await asyncio.sleep(30)  # until cancelled

    flaky = FlakyStore(pg_store)
    flaky.down = {"heartbeat"}
    async with running_worker(app, flaky, redis_bus, lease_s=30.0):
        instance = await Dispatcher(pg_store, redis_bus).trigger("reports")

        async def progress_refused() -> bool:
            return any(instance.id in (args[2] or {}) for args in flaky.refusals("heartbeat"))

        await wait_for(progress_refused, what="a heartbeat carrying the progress to fail")
        flaky.down.clear()

        async def progress_written() -> bool:
            return (await pg_store.get_instance(instance.id)).progress == 0.5

        await wait_for(progress_written, timeout_s=10, what="the progress to be written")
        await Dispatcher(pg_store, redis_bus).cancel(instance.id, "test")
        [done] = await settled(pg_store, [instance.id])
    assert done.progress == 0.5 and done.progress_message == "half"


async def test_a_store_error_while_republishing_parked_instances_is_not_fatal(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("parking")

    @app.triggered(max_concurrency=1, on_limit="wait")
    async def one_at_a_time() -> None:
        await asyncio.sleep(0.3)

    flaky = FlakyStore(pg_store)
    flaky.fail_next["republish_waiting"] = 1
    async with running_worker(app, flaky, redis_bus, concurrency=4) as worker:
        dispatcher = Dispatcher(pg_store, redis_bus)
        made = [await dispatcher.trigger("one_at_a_time") for _ in range(2)]
        done = await settled(pg_store, [i.id for i in made])
        assert worker.running == {}
    assert len(flaky.refusals("republish_waiting")) == 1
    assert {i.state for i in done} == {S.SUCCEEDED}


async def test_the_release_at_shutdown_is_retried_through_a_store_outage(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    app = App("released")

    @app.triggered()
    async def long() -> None:
        await asyncio.sleep(30)

    flaky = FlakyStore(pg_store)
    async with running_worker(app, flaky, redis_bus, grace_s=0.2, lease_s=5.0):
        instance = await Dispatcher(pg_store, redis_bus).trigger("long")

        async def running() -> bool:
            return (await pg_store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(running)
        flaky.fail_next["transition"] = 2
    released = await pg_store.get_instance(instance.id)
    assert len(flaky.refusals("transition")) == 2
    assert released.state is S.ENQUEUED and released.reason == "worker shutdown"
    assert released.retries_used == 0 and released.unexpected_retries_used == 0


async def test_the_release_at_shutdown_is_retried_through_a_postgres_restart(
    pg_store: SqlStore, pg_database_url: str, redis_bus: Bus
) -> None:
    """The drain cancels the async job's task, which then releases its instance: a driver
    error met there is an outage, retried, not taken for the task's cancel (left to the reaper,
    an unexpected retry counted)."""
    app = App("restarting")

    @app.triggered()
    async def long() -> None:
        await asyncio.sleep(30)

    url = make_url(pg_database_url)
    server = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    port = await server.start()
    proxied = open_store(url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False))
    try:
        async with running_worker(app, proxied, redis_bus, grace_s=0.2, lease_s=5.0):
            instance = await Dispatcher(pg_store, redis_bus).trigger("long")

            async def running() -> bool:
                return (await pg_store.get_instance(instance.id)).state is S.PROCESSING

            await wait_for(running)
            server.down()  # Postgres restarts as the worker stops...
            asyncio.get_running_loop().call_later(0.8, server.up)  # ... and is back soon
        released = await pg_store.get_instance(instance.id)
    finally:
        await proxied.close()
        await server.close()
    assert released.state is S.ENQUEUED and released.reason == "worker shutdown"
    assert released.retries_used == 0 and released.unexpected_retries_used == 0


async def test_after_an_outage_longer_than_the_lease_a_finished_outcome_is_kept(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """Postgres is away for everyone for over twice the lease while a job ends: when it returns,
    every lease looks expired. The leader waits ``reap_grace_s`` before reaping, so the
    worker's waiting outcome is written first: the job ran once and is not run again."""
    app = App("outage")
    finish = asyncio.Event()

    @app.triggered()
    async def waits() -> str:
        await finish.wait()
        return "done"

    worker_store, leader_store = FlakyStore(pg_store), FlakyStore(pg_store)
    async with (
        running_worker(app, worker_store, redis_bus, lease_s=1.5, heartbeat_s=0.3),
        running_scheduler(cast(SqlStore, leader_store), redis_bus, reap_grace_s=6.0),
    ):
        instance = await Dispatcher(pg_store, redis_bus).trigger("waits")

        async def running() -> bool:
            return (await pg_store.get_instance(instance.id)).state is S.PROCESSING

        await wait_for(running, what="the attempt to start")
        worker_store.all_down = leader_store.all_down = True
        finish.set()  # it ends during the outage: its outcome waits in the worker
        await asyncio.sleep(4.0)  # more than twice the lease
        worker_store.all_down = leader_store.all_down = False
        [done] = await settled(pg_store, [instance.id], timeout_s=30)
    assert done.state is S.SUCCEEDED and done.attempt == 1
    moves = [(t.from_state, t.to_state) for t in await pg_store.transitions(instance.id)]
    assert (S.PROCESSING, S.ENQUEUED) not in moves  # never reaped and run again


async def test_a_store_outage_while_registering_is_waited_out(
    pg_store: SqlStore, redis_bus: Bus
) -> None:
    """Postgres restarting right after the startup check: the worker's first registrations
    fail as unavailable, and it registers once the store answers, instead of exiting."""
    app = App("late")

    @app.triggered()
    async def quick(ctx: JobContext) -> int:
        return ctx.attempt

    flaky = FlakyStore(pg_store)
    flaky.fail_next["register_definition"] = 2
    async with running_worker(app, flaky, redis_bus):
        made = await Dispatcher(pg_store, redis_bus).trigger("quick")
        [done] = await settled(pg_store, [made.id], timeout_s=15)
    assert [name for name, _ in flaky.refused] == ["register_definition"] * 2
    assert done.state is S.SUCCEEDED
