"""Resident memory of each role's process at rest: a worker (plain, and with its probe port),
a scheduler and the API, each a real ``jobplane`` process on a fresh Postgres database and a
Redis key prefix of its own.

    .venv/bin/python -m bench.memory [--settle 5] [--roles worker worker+health scheduler api]

Each process is started alone, waited for until it is up (the worker registered, the scheduler
leader, the API ready), left idle ``--settle`` seconds, then read from ``/proc/<pid>/status``
and stopped with SIGTERM: ``VmRSS`` (resident now), of it ``RssAnon`` (the process's own heap;
the rest, ``RssFile``, is mapped shared libraries, shared with every process that maps them)
and ``VmHWM`` (the peak). Figures are printed, not checked. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import REDIS_URL, ROOT, environment
from jobplane.store.sql import SqlStore

ROLES = ("worker", "worker+health", "scheduler", "api")
#: How long a role gets to come up before the benchmark gives up on it.
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Reading:
    role: str
    rss_kb: int
    anon_kb: int
    peak_kb: int
    threads: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def command(role: str, app: str, port: int) -> list[str]:
    jobplane = str(Path(sys.executable).parent / "jobplane")
    if role == "worker":
        return [jobplane, "worker", "--app", app, "--worker-id", "bench-memory"]
    if role == "worker+health":
        return [
            *[jobplane, "worker", "--app", app, "--worker-id", "bench-memory"],
            *["--health-port", str(port)],
        ]
    if role == "scheduler":
        return [jobplane, "scheduler"]
    if role == "api":
        return [jobplane, "api", "--host", "127.0.0.1", "--port", str(port)]
    raise ValueError(f"unknown role {role}")


def status(pid: int) -> dict[str, int]:
    """The kB (and count) fields of ``/proc/<pid>/status`` this benchmark reads."""
    wanted = {"VmRSS", "RssAnon", "VmHWM", "Threads"}
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in wanted:
            found[name] = int(value.split()[0])
    return found


def up_check(role: str, store: SqlStore, port: int) -> Callable[[], Awaitable[bool]]:
    """Whether the role's process is up: what "up" means differs by role."""

    async def worker_registered() -> bool:
        return any(w.id == "bench-memory" for w in await store.list_workers())

    async def leader_elected() -> bool:
        return await store.get_leader(0) is not None

    async def api_ready() -> bool:
        try:
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{port}/readyz")
        except httpx.TransportError:
            return False
        return answer.status_code == 200

    if role.startswith("worker"):
        return worker_registered
    return leader_elected if role == "scheduler" else api_ready


async def measure(role: str, app: str, settle_s: float) -> Reading:
    async with environment() as (url, prefix, store):
        port = free_port()
        env = {
            **os.environ,
            "JOBPLANE_DATABASE_URL": url,
            "JOBPLANE_REDIS_URL": REDIS_URL,
            "JOBPLANE_KEY_PREFIX": prefix,
            "JOBPLANE_AUTH_ENABLED": "false",
            "JOBPLANE_LOG_LEVEL": "WARNING",
        }
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(
                command(role, app, port), cwd=ROOT, env=env, stdout=log, stderr=log
            )
            try:
                is_up = up_check(role, store, port)
                deadline = time.monotonic() + START_TIMEOUT_S
                while not await is_up():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        print(log.read()[-4000:].decode(errors="replace"), file=sys.stderr)
                        raise RuntimeError(f"{role} did not come up (exit {proc.returncode})")
                    await asyncio.sleep(0.1)
                await asyncio.sleep(settle_s)
                found = status(proc.pid)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    return Reading(role, found["VmRSS"], found["RssAnon"], found["VmHWM"], found["Threads"])


async def main(ns: argparse.Namespace) -> None:
    readings = [await measure(role, ns.app, ns.settle) for role in ns.roles]
    print(f"\nIdle resident memory ({ns.settle:g} s after start-up; app {ns.app})")
    print(f"{'role':<14} {'RSS MB':>7} {'anon MB':>8} {'peak MB':>8} {'threads':>8}")
    for r in readings:
        rss, anon, peak = (kb / 1024 for kb in (r.rss_kb, r.anon_kb, r.peak_kb))
        print(f"{r.role:<14} {rss:>7.1f} {anon:>8.1f} {peak:>8.1f} {r.threads:>8}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=5.0, help="Idle seconds before reading.")
    parser.add_argument("--roles", nargs="+", choices=ROLES, default=list(ROLES))
    parser.add_argument("--app", default="bench.apps:app", help="The workers' App.")
    asyncio.run(main(parser.parse_args()))
