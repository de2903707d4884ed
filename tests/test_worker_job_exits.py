"""Job code that ends as scripts do (``sys.exit()``, ``KeyboardInterrupt``) ends its attempt,
never the worker: asyncio re-raises those out of the event loop, which ended the process. Real
``jobplane worker`` processes (this module is their app), Postgres and Redis. A real SIGINT is
still the worker's graceful stop."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from subprocess import Popen

import pytest

from jobplane import App, JobContext
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from tests.cli_helpers import output_of, spawn_cli, stop_all, wait_for_output
from tests.worker_helpers import settled, wait_for

pytestmark = pytest.mark.timeout(120)

app = App("exits")


@app.triggered()
def exits_sync() -> None:
    sys.exit(3)  # a script's entry point reused as a job; argparse on a bad argument


@app.triggered()
async def exits_async() -> None:
    raise SystemExit(4)


@app.triggered()
def interrupted_sync() -> None:
    raise KeyboardInterrupt


@app.triggered()
async def interrupted_async() -> None:
    raise KeyboardInterrupt


@app.triggered()
def closes_sync() -> None:
    raise GeneratorExit("closed")  # a generator's protocol, raised by hand


@app.triggered()
async def closes_async() -> None:
    raise GeneratorExit("closed")


@app.triggered()
async def checkpoints_blocking(ctx: JobContext) -> None:
    ctx.checkpoint_sync({"step": 1})  # the sync form, on the worker's own loop


@app.triggered(timeout_s=0.5)
def runaway_exits() -> None:
    time.sleep(1.5)  # ignores its timeout: a runaway, whose thread then exits
    sys.exit(5)


@app.triggered()
async def sleeps() -> str:
    await asyncio.sleep(30)
    return "slept"


@app.triggered()
async def ok() -> str:
    return "ok"


@pytest.fixture
def worker(pg_database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Popen[str]]:
    proc = spawn_cli(
        "worker",
        "--app",
        f"{__name__}:app",
        "--worker-id",
        "exits",
        "--grace",
        "0.5",
        JOBPLANE_DATABASE_URL=pg_database_url,
        JOBPLANE_REDIS_URL=redis_url,
        JOBPLANE_KEY_PREFIX=redis_prefix,
        JOBPLANE_HEARTBEAT_S="0.3",
        JOBPLANE_POLL_MS="100",
        JOBPLANE_TIMEOUT_GRACE_S="0.2",
    )
    yield proc
    stop_all([proc])


async def test_a_job_that_exits_or_is_interrupted_fails_and_the_worker_serves_on(
    pg_store: SqlStore, redis_bus: Bus, worker: Popen[str]
) -> None:
    await wait_for_output(worker, "worker exits ready")
    dispatcher = Dispatcher(pg_store, redis_bus)
    keys = [
        "exits_sync",
        "exits_async",
        "interrupted_sync",
        "interrupted_async",
        "closes_sync",
        "closes_async",
        "checkpoints_blocking",
        "runaway_exits",
    ]
    made = [await dispatcher.trigger(key) for key in keys]

    async def ended() -> bool:
        assert worker.poll() is None, f"the worker exited ({worker.returncode})"
        return all([(await pg_store.get_instance(i.id)).state.is_terminal for i in made])

    await wait_for(ended, timeout_s=30, what="the jobs to end")
    done = {i.job_key: i for i in await settled(pg_store, [i.id for i in made])}
    assert {k: i.attempt for k, i in done.items()} == dict.fromkeys(keys, 1)
    errors = {k: (i.state, i.error and (i.error.type, i.error.message)) for k, i in done.items()}
    assert errors == {
        "exits_sync": (S.TERMINATED, ("SystemExit", "3")),
        "exits_async": (S.TERMINATED, ("SystemExit", "4")),
        "interrupted_sync": (S.TERMINATED, ("KeyboardInterrupt", "")),
        "interrupted_async": (S.TERMINATED, ("KeyboardInterrupt", "")),
        # Re-raised as a close of the attempt, nothing was recorded and the code ran 4 times.
        "closes_sync": (S.TERMINATED, ("GeneratorExit", "closed")),
        "closes_async": (S.TERMINATED, ("GeneratorExit", "closed")),
        # It waited on the loop it blocked: the worker froze for good.
        "checkpoints_blocking": (
            S.TERMINATED,
            (
                "RuntimeError",
                "checkpoint_sync() blocks: from an async job, use `await ctx.checkpoint(...)`",
            ),
        ),
        "runaway_exits": (S.TERMINATED, ("TimeoutError", "timed out after 0.5 s")),
    }
    # The runaway's thread exits (SystemExit) too, 1.5 s in: discarded, like whatever it does.
    await wait_for_output(worker, "raised SystemExit: 5 at last; discarded", timeout_s=10)
    assert worker.poll() is None
    [served] = await settled(pg_store, [(await dispatcher.trigger("ok")).id], timeout_s=10)
    assert served.state is S.SUCCEEDED and served.result == "ok"

    # A real SIGINT (Ctrl-C) is the worker's graceful stop, as SIGTERM: the running job is
    # released for another worker, no retry used, and the process exits cleanly.
    running = await dispatcher.trigger("sleeps")

    async def processing() -> bool:
        return (await pg_store.get_instance(running.id)).state is S.PROCESSING

    await wait_for(processing, what="the job to run")
    worker.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(worker.wait, 30) == 0, output_of(worker)
    released = await pg_store.get_instance(running.id)
    assert released.state is S.ENQUEUED and released.reason == "worker shutdown"
    assert released.retries_used == 0
