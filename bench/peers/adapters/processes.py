"""The worker processes of one system: started in their own process groups, measured through
/proc, stopped with SIGTERM (SIGKILL after a grace period). Standard library only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Memory:
    """Resident memory of a worker tree: the processes that run jobs (those without children)
    and the supervisors above them, if the system has any."""

    workers_mb: float
    workers: int
    supervisors_mb: float
    supervisors: int


class Workers:
    """Starts ``commands`` (one process tree each) and owns every process in them."""

    def __init__(self, commands: Sequence[Sequence[str]], env: Mapping[str, str], cwd: str):
        self._commands = commands
        self._env = dict(env)
        self._cwd = cwd
        self._procs: list[subprocess.Popen[bytes]] = []
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())

    def start(self) -> float:
        """Start every command; returns ``time.time()`` just before the first one."""
        started = time.time()
        for command in self._commands:
            self._procs.append(
                subprocess.Popen(
                    list(command),
                    cwd=self._cwd,
                    env=self._env,
                    stdout=self._log,
                    stderr=self._log,
                    start_new_session=True,
                )
            )
        return started

    def check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                log = self.log()
                raise RuntimeError(f"worker {proc.args!r} exited with {proc.returncode}:\n{log}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:].decode(errors="replace")

    def memory(self) -> Memory:
        tree = _descendants([p.pid for p in self._procs])
        parents = {_parent(pid) for pid in tree}
        leaves = [pid for pid in tree if pid not in parents]
        inner = [pid for pid in tree if pid in parents]
        return Memory(_rss_mb(leaves), len(leaves), _rss_mb(inner), len(inner))

    async def settle(self, minimum_s: float, maximum_s: float = 30.0) -> Memory:
        """Wait until the trees have started up (memory steady for a second, at least
        ``minimum_s``), then measure them."""
        import asyncio

        started = time.monotonic()
        previous = self.memory()
        while True:
            await asyncio.sleep(0.5)
            self.check_alive()
            now = self.memory()
            steady = now.workers == previous.workers
            steady = steady and abs(now.workers_mb - previous.workers_mb) < 0.5
            elapsed = time.monotonic() - started
            if (steady and elapsed >= minimum_s) or elapsed >= maximum_s:
                return now
            previous = now

    def stop(self) -> None:
        """SIGTERM to each process group, SIGKILL to those still there after the grace; returns
        once every process of the trees is gone (a dying consumer must not take the next
        phase's messages)."""
        tree = _descendants([p.pid for p in self._procs])
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for proc in self._procs:
            # Children a supervisor left behind (its group outlives it).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        while any(_alive(pid) for pid in tree):
            time.sleep(0.05)
        self._procs.clear()
        self._log.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as src:
            return src.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as src:
            return int(src.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _descendants(roots: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(_parent(int(entry)), []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if os.path.exists(f"/proc/{pid}"):
            found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _rss_mb(pids: list[int]) -> float:
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", encoding="utf-8") as src:
                for line in src:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total_kb / 1024
