"""Run the real ``jobplane`` command in a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parent.parent
JOBPLANE = str(Path(sys.executable).parent / "jobplane")


def jobplane_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env.update(overrides)
    return env


def run_cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JOBPLANE, *args],
        cwd=ROOT,
        env=jobplane_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def spawn_cli(*args: str, **env: str) -> subprocess.Popen[str]:
    """Start ``jobplane ARGS``. Its output goes to a temporary file, never to a pipe nobody
    reads: a full pipe would block the process's logging and freeze it mid-test."""
    log = tempfile.TemporaryFile(mode="w+", prefix="jobplane-proc-")  # noqa: SIM115 (closed in stop_all)
    proc = subprocess.Popen(
        [JOBPLANE, *args], cwd=ROOT, env=jobplane_env(**env), stdout=log, stderr=log, text=True
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
    for proc in procs:
        proc.wait(timeout=30)
        log = _logs.pop(proc.pid, None)
        if log is not None:
            log.seek(0)
            tail = log.read()[-4000:]
            log.close()
            command = " ".join(map(str, proc.args))
            sys.stderr.write(f"--- {command} (exit {proc.returncode}) ---\n{tail}\n")


def output_of(proc: subprocess.Popen[str]) -> str:
    """What ``proc`` (started by :func:`spawn_cli`) printed so far. Read at an offset, never
    moving the file position the process writes at."""
    log = _logs.get(proc.pid)
    if log is None:
        return ""
    return os.pread(log.fileno(), 1 << 22, 0).decode(errors="replace")


async def wait_for_output(proc: subprocess.Popen[str], text: str, timeout_s: float = 60) -> None:
    """Wait until ``proc`` has printed ``text`` (e.g. it has started and handles signals)."""
    deadline = time.monotonic() + timeout_s
    while text not in output_of(proc):
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited ({proc.returncode}) before {text!r}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.args} did not print {text!r} in {timeout_s} s")
        await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http_ok(url: str, timeout_s: float = 30) -> None:
    """Wait until ``url`` answers 200 (a server process starting up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer in {timeout_s:g} s")
