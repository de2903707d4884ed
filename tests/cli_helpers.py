"""Run the real ``jobplane`` command in a subprocess."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parent.parent
JOBPLANE = str(Path(sys.executable).parent / "jobplane")


def jobplane_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env.update(overrides)
    return env


def run_cli(
    *args: str, timeout: float = 60, env: Mapping[str, str] | None = None, **overrides: str
) -> subprocess.CompletedProcess[str]:
    """Run ``jobplane *args`` to its end, in :func:`jobplane_env` with ``env`` and then the
    keywords set. (A mapping goes in ``env``: spread as keywords, its keys could be ``timeout``.)"""
    return subprocess.run(
        [JOBPLANE, *args],
        cwd=ROOT,
        env=jobplane_env(**{**(env or {}), **overrides}),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def spawn_cli(*args: str, **env: str) -> subprocess.Popen[str]:
    """Start ``jobplane ARGS``. Its output goes to a temporary file, never to a pipe nobody
    reads: a full pipe would block the process's logging and freeze it mid-test."""
    return _spawn(args, env, session=False)


def spawn_cli_leading(*args: str, **env: str) -> subprocess.Popen[str]:
    """:func:`spawn_cli`, the process leading a process group of its own, as when started from
    a terminal or by a supervisor (a signal to its group then reaches it, not the tests)."""
    return _spawn(args, env, session=True)


def _spawn(args: tuple[str, ...], env: dict[str, str], *, session: bool) -> subprocess.Popen[str]:
    log = tempfile.TemporaryFile(mode="w+", prefix="jobplane-proc-")  # noqa: SIM115 (closed in stop_all)
    proc = subprocess.Popen(
        [JOBPLANE, *args],
        cwd=ROOT,
        env=jobplane_env(**env),
        stdout=log,
        stderr=log,
        text=True,
        start_new_session=session,
    )
    _logs[proc.pid] = log
    return proc


_logs: dict[int, IO[str]] = {}


def stop_all(procs: list[subprocess.Popen[str]], *, sig: int = signal.SIGKILL) -> None:
    """Stop the processes (resuming any frozen one first) and print the end of each one's
    output, which pytest shows when the test failed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(sig)
    hung: list[str] = []
    for proc in procs:
        command = _command(proc)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Killed and reaped all the same: one left running would outlive its test and
            # fail a later one on the same worker (an unraisable ResourceWarning).
            hung.append(command)
            proc.kill()
            proc.wait(timeout=30)
        log = _logs.pop(proc.pid, None)
        if log is not None:
            log.seek(0)
            tail = log.read()[-4000:]
            log.close()
            sys.stderr.write(f"--- {command} (exit {proc.returncode}) ---\n{tail}\n")
    if hung:
        raise AssertionError(f"did not stop within 30 s of signal {sig}: {hung}")


def _command(proc: subprocess.Popen[str]) -> str:
    """``proc``'s command line, its words joined by spaces."""
    args = proc.args
    if isinstance(args, str | bytes | os.PathLike):
        return str(args)
    return " ".join(map(str, args))


def output_of(proc: subprocess.Popen[str], limit: int = 1 << 22) -> str:
    """What ``proc`` (started by :func:`spawn_cli`) printed so far, its first ``limit`` bytes
    (``0``: all of it). Read at an offset, never moving the file position the process writes
    at."""
    log = _logs.get(proc.pid)
    if log is None:
        return ""
    size = limit or os.fstat(log.fileno()).st_size
    return os.pread(log.fileno(), size, 0).decode(errors="replace")


def output_size(proc: subprocess.Popen[str]) -> int:
    """Bytes ``proc`` (started by :func:`spawn_cli`) has printed so far."""
    log = _logs.get(proc.pid)
    return 0 if log is None else os.fstat(log.fileno()).st_size


async def wait_for_output(proc: subprocess.Popen[str], text: str, timeout_s: float = 60) -> None:
    """Wait until ``proc`` has printed ``text`` (e.g. it has started and handles signals)."""
    deadline = time.monotonic() + timeout_s
    while text not in output_of(proc):
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited ({proc.returncode}) before {text!r}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.args!r} did not print {text!r} in {timeout_s} s")
        await asyncio.sleep(0.05)


# Ports handed out for servers the tests start: below the kernel's ephemeral range (32768 and up
# by default), so no outgoing connection takes one between free_port() and the server's bind;
# and a slice of its own per pytest-xdist worker, so two workers never hand out the same port.
PORTS_FROM = 20000
PORTS_PER_WORKER = 1000
WORKER_SLICES = 12


def _worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` → 3); 0 in a run without workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


def _ports() -> Iterator[int]:
    first = PORTS_FROM + PORTS_PER_WORKER * (_worker_index() % WORKER_SLICES)
    start = random.randrange(PORTS_PER_WORKER)  # another run on this host starts elsewhere
    while True:
        for step in range(PORTS_PER_WORKER):
            yield first + (start + step) % PORTS_PER_WORKER


_next_ports = _ports()


def free_port() -> int:
    """A port nothing listens on now, for a server to be started on it."""
    for _ in range(PORTS_PER_WORKER):
        port = next(_next_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: by a server of this run's or anyone else's
            return port
    raise RuntimeError(f"no free port in worker slice {_worker_index()}")


def wait_http_ok(
    url: str, timeout_s: float = 60, proc: subprocess.Popen[str] | None = None
) -> None:
    """Wait until ``url`` answers 200 (a server process starting up: a minute, since a
    start takes tens of seconds on a loaded machine). With ``proc`` (the server's process),
    its exit ends the wait at once, with the end of its output."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"the server of {url} exited with status {proc.returncode} before answering:\n"
                + output_of(proc, limit=0)[-3000:]
            )
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer in {timeout_s:g} s")
