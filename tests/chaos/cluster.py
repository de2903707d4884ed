"""The roles as real ``jobplane`` processes, each reaching Postgres and Redis through proxies
of its own, so that one role can be partitioned while the others are not."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.apps.chaos import RUNS_ENV
from tests.chaos.logscan import Scan, scan
from tests.chaos.servers import ChaosProxy, Postgres, Redis
from tests.cli_helpers import (
    free_port,
    output_of,
    output_size,
    spawn_cli,
    stop_all,
    wait_http_ok,
)

APP = "tests.apps.chaos:app"
#: Short leases and sweeps, so that a fault is noticed and repaired within seconds.
TIMING = {
    "JOBPLANE_LEASE_S": "2",
    "JOBPLANE_HEARTBEAT_S": "0.4",
    "JOBPLANE_POLL_MS": "200",
    "JOBPLANE_RECLAIM_IDLE_S": "3",
    "JOBPLANE_GRACE_S": "3",
    # A sync job past its timeout is a runaway 0.3 s later (the ``runaway`` job).
    "JOBPLANE_TIMEOUT_GRACE_S": "0.3",
    "JOBPLANE_LEASE_TTL_S": "2",
    "JOBPLANE_SWEEP_INTERVAL_S": "0.5",
    "JOBPLANE_REPUBLISH_AFTER_S": "5",
    "JOBPLANE_DEAD_WORKER_AFTER_S": "10",
    "JOBPLANE_DB_POOL_SIZE": "5",
    # One JSON object a line: the crash scan (``logscan``) reads each record's level and action.
    "JOBPLANE_LOG_FORMAT": "json",
}


@dataclass
class Role:
    """One role process (restarted under the same name, id and proxies)."""

    name: str
    kind: str  # "api", "scheduler" or "worker"
    pg: ChaosProxy
    redis: ChaosProxy
    port: int = 0
    proc: subprocess.Popen[str] | None = None
    #: Set while the harness itself stops the process (its exit is then expected).
    stopping: bool = False
    #: Set while a fault holds the role (no second fault takes it).
    busy: bool = False
    exits: list[int] = field(default_factory=list)
    #: When (monotonic) its current process answered its health probe; ``None`` while down.
    ready_at: float | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Unexpected:
    """A process that exited without the harness stopping it, or stopped with a bad status."""

    role: str
    status: int | None
    tail: str


class Cluster:
    def __init__(self, pg: Postgres, redis: Redis, token: str, runs: Path) -> None:
        self.pg = pg
        #: Where the workers' jobs note their runs (``tests/apps/chaos.py``).
        self.runs = runs
        self.redis = redis
        self.token = token
        self.roles: dict[str, Role] = {}
        self.unexpected: list[Unexpected] = []
        #: Every process started, with its role's name.
        self._procs: list[tuple[str, subprocess.Popen[str]]] = []
        #: Bytes a process had printed when the harness sent it SIGKILL (by pid).
        self._killed_at: dict[int, int] = {}

    async def add(self, name: str, kind: str) -> Role:
        pg, redis = ChaosProxy(self.pg.port), ChaosProxy(self.redis.port)
        await pg.start()
        await redis.start()
        role = Role(name, kind, pg, redis, port=free_port())
        self.roles[name] = role
        return role

    def up_for(self, name: str) -> float | None:
        """Seconds since role ``name``'s current process became ready; ``None`` while down."""
        role = self.roles.get(name)
        if role is None or role.ready_at is None or not role.running:
            return None
        return time.monotonic() - role.ready_at

    def of_kind(self, kind: str) -> list[Role]:
        return [r for r in self.roles.values() if r.kind == kind]

    @property
    def proxies(self) -> list[ChaosProxy]:
        return [p for r in self.roles.values() for p in (r.pg, r.redis)]

    async def start(self, role: Role) -> None:
        env = {
            "JOBPLANE_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{role.pg.port}/postgres",
            "JOBPLANE_REDIS_URL": f"redis://127.0.0.1:{role.redis.port}/0",
            "JOBPLANE_KEY_PREFIX": "chaos",
            "JOBPLANE_HEALTH_HOST": "127.0.0.1",
            **TIMING,
        }
        if role.kind == "api":
            args = ["api", "--host", "127.0.0.1", "--port", str(role.port)]
        elif role.kind == "scheduler":
            args = ["scheduler", "--health-port", str(role.port)]
            env["JOBPLANE_SCHEDULER_ID"] = role.name
        else:
            args = ["worker", "--app", APP, "--worker-id", role.name]
            env[RUNS_ENV] = str(self.runs)
            args += ["--health-port", str(role.port)]
        role.stopping = False
        role.proc = spawn_cli(*args, **env)
        self._procs.append((role.name, role.proc))
        url = f"http://127.0.0.1:{role.port}/healthz"
        # Generous: six processes importing at once on a busy machine can take over a minute.
        await asyncio.to_thread(wait_http_ok, url, 150, role.proc)
        role.ready_at = time.monotonic()

    def send(self, role: Role, sig: signal.Signals) -> None:
        if role.running and role.proc is not None:
            role.proc.send_signal(sig)

    async def stop(self, role: Role, sig: signal.Signals = signal.SIGTERM) -> int | None:
        """Stop the role's process with ``sig`` and wait for it; a SIGTERM must end it with
        status 0 (a graceful stop), anything else is recorded as unexpected."""
        proc = role.proc
        if proc is None:
            return None
        role.stopping = True
        role.ready_at = None
        if proc.poll() is None:
            if sig is signal.SIGKILL:
                self._killed_at[proc.pid] = output_size(proc)
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(sig)
        try:
            status = await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = await asyncio.to_thread(proc.wait, 10)
            self.unexpected.append(Unexpected(role.name, None, "did not stop within 60 s"))
        role.exits.append(status)
        # A SIGTERM must end in 0 (a graceful stop); any other signal in death by that signal.
        expected = 0 if sig is signal.SIGTERM else -sig
        if status != expected:
            self.unexpected.append(Unexpected(role.name, status, _tail(proc)))
        role.proc = None
        return status

    def check_alive(self) -> None:
        """Record every process that exited while the harness did not stop it."""
        for role in self.roles.values():
            proc = role.proc
            if proc is not None and not role.stopping and proc.poll() is not None:
                self.unexpected.append(Unexpected(role.name, proc.returncode, _tail(proc)))
                role.proc = None
                role.ready_at = None

    def scan_logs(self) -> Scan:
        """Crashes in the output of every process so far, and the errors they handled (see
        :mod:`tests.chaos.logscan`); output printed after a SIGKILL is not judged."""
        found = Scan()
        for name, proc in self._procs:
            killed_at = self._killed_at.get(proc.pid)
            if killed_at is None:
                text = output_of(proc, limit=0)
            else:
                text = output_of(proc, limit=killed_at) if killed_at else ""
            scan(name, text, found)
        return found

    async def close(self) -> None:
        await asyncio.to_thread(_quietly_stop, [p for _, p in self._procs])
        for proxy in self.proxies:
            await proxy.close()


def _tail(proc: subprocess.Popen[str]) -> str:
    return output_of(proc, limit=0)[-3000:]


def _quietly_stop(procs: list[subprocess.Popen[str]]) -> None:
    """Kill what still runs; print the end of each process's output (to stderr)."""
    stop_all(procs, sig=signal.SIGKILL)
