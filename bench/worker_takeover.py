"""Takeover of a killed worker's instance: two worker processes and a scheduler; the worker
running a long attempt is killed (SIGKILL, so it records nothing); the clock runs on the
database's time from the kill to the start of the instance's next attempt on the other worker.

    .venv/bin/python -m bench.worker_takeover [--rounds 3] [--timing 2:10 --timing 1:3]

``--timing HEARTBEAT:LEASE`` (seconds; may be given several times) sets the workers'
``JOBPLANE_HEARTBEAT_S`` and ``JOBPLANE_LEASE_S``; the default is the defaults, 2:10. A killed
worker's attempt keeps its lease until the lease runs out (a worker that is only slow or cut
off must not lose its instance earlier); the leader's sweep (``JOBPLANE_SWEEP_INTERVAL_S``,
1 s) then releases it and publishes it again, and the other worker claims it. So the takeover
is about the lease plus up to one sweep interval, whatever the heartbeat.

A new leader releases no expired lease for its first ``JOBPLANE_REAP_GRACE_S`` (6 s: after an
outage the workers renew first), so the rounds start once the scheduler has led that long:
a kill earlier would measure the grace, not the takeover."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from itertools import count
from uuid import UUID

from bench.common import (
    REDIS_URL,
    ROOT,
    bus_for,
    environment,
    percentile,
    stop_processes,
    wait_until,
)
from jobplane.dispatch import Dispatcher
from jobplane.domain.states import InstanceState
from jobplane.store.sql import SqlStore
from jobplane_scheduler.settings import SchedulerSettings


def _spawn(
    url: str, prefix: str, role: Sequence[str], extra: dict[str, str]
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": url,
        "JOBPLANE_REDIS_URL": REDIS_URL,
        "JOBPLANE_KEY_PREFIX": prefix,
        "JOBPLANE_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
        **extra,
    }
    command = [os.path.join(os.path.dirname(sys.executable), "jobplane"), *role]
    return subprocess.Popen(command, cwd=ROOT, env=env)


class Cluster:
    """A scheduler and two workers with the given heartbeat and lease; a killed worker is
    replaced by a new one (a new id), so two workers always run."""

    def __init__(self, url: str, prefix: str, heartbeat: float, lease: float) -> None:
        self.url, self.prefix = url, prefix
        self.timing = {"JOBPLANE_HEARTBEAT_S": str(heartbeat), "JOBPLANE_LEASE_S": str(lease)}
        self.ids = count()
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.gone: list[subprocess.Popen[bytes]] = []
        self.scheduler = _spawn(url, prefix, ["scheduler"], {})

    def add_worker(self) -> None:
        worker_id = f"takeover-{next(self.ids)}"
        role = ["worker", "--app", "bench.apps:app", "--worker-id", worker_id]
        self.workers[worker_id] = _spawn(self.url, self.prefix, role, self.timing)

    def kill(self, worker_id: str) -> None:
        proc = self.workers.pop(worker_id)
        proc.send_signal(signal.SIGKILL)
        self.gone.append(proc)

    def close(self) -> None:
        stop_processes([self.scheduler, *self.workers.values(), *self.gone])


async def _running(store: SqlStore, instance_id: UUID, after_attempt: int) -> bool:
    instance = await store.get_instance(instance_id)
    return instance.state is InstanceState.PROCESSING and instance.attempt > after_attempt


async def one_round(
    store: SqlStore, cluster: Cluster, dispatcher: Dispatcher, pause: float
) -> float:
    made = await dispatcher.trigger("hold", {"seconds": 600})
    await wait_until(lambda: _running(store, made.id, 0), timeout_s=60)
    # A kill at a random moment of the heartbeat and of the leader's sweep: rounds that
    # follow each other in lockstep would all meet both at the same phase.
    await asyncio.sleep(pause)
    first = await store.get_instance(made.id)
    assert first.worker_id is not None
    killed_at = await store.now()
    cluster.kill(first.worker_id)
    cluster.add_worker()  # two workers again; the survivor is free to take it at once
    await wait_until(lambda: _running(store, made.id, first.attempt), timeout_s=120)
    again = await store.get_instance(made.id)
    assert again.started_at is not None and again.worker_id != first.worker_id
    await dispatcher.cancel(made.id)
    return (again.started_at - killed_at).total_seconds()


async def main(rounds: int, timings: list[tuple[float, float]]) -> None:
    rows = []
    for heartbeat, lease in timings:
        async with environment() as (url, prefix, store):
            cluster = Cluster(url, prefix, heartbeat, lease)
            bus = bus_for(prefix)
            try:
                cluster.add_worker()
                cluster.add_worker()
                started = time.monotonic()
                while len(await store.list_workers()) < 2:
                    if time.monotonic() - started > 60:
                        raise RuntimeError("the workers did not register in 60 s")
                    await asyncio.sleep(0.1)
                # (The leader's start-up grace: see the docstring.)
                while await store.get_leader(0) is None:
                    if time.monotonic() - started > 60:
                        raise RuntimeError("no scheduler led in 60 s")
                    await asyncio.sleep(0.1)
                await asyncio.sleep(SchedulerSettings().reap_grace_s)
                dispatcher = Dispatcher(store, bus)
                pauses = random.Random(rounds).uniform
                times = [
                    await one_round(store, cluster, dispatcher, pauses(0, max(heartbeat, 1.0)))
                    for _ in range(rounds)
                ]
            finally:
                await bus.close()
                cluster.close()
        median = percentile(times, 0.5)
        each = ", ".join(f"{t:.2f}" for t in times)
        rows.append(
            f"| {heartbeat:g} | {lease:g} | {median:.2f} | {max(times):.2f} "
            f"| {median / heartbeat:.1f} | {each} |"
        )
    print(f"\nTakeover of a SIGKILLed worker's instance ({rounds} rounds each)\n")
    print("| heartbeat s | lease s | takeover median s | max s | median ÷ heartbeat | rounds s |")
    print("|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))


def _timing(text: str) -> tuple[float, float]:
    heartbeat, _, lease = text.partition(":")
    return float(heartbeat), float(lease)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timing", type=_timing, action="append", metavar="HEARTBEAT:LEASE")
    ns = parser.parse_args()
    asyncio.run(main(ns.rounds, ns.timing or [(2.0, 10.0)]))
