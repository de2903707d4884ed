"""The harness's own servers, which it may kill and restart: a PostgreSQL cluster (initdb in a
temporary directory, on a free port), a ``redis-server`` on a free port without persistence,
and a TCP proxy per role and server that it may partition or slow down."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.cli_helpers import free_port


class HarnessUnavailableError(RuntimeError):
    """The machine lacks what the harness needs (server binaries, root to run Postgres)."""


def missing_requirement() -> str | None:
    """Why the harness cannot run here, or ``None``."""
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        return "needs the PostgreSQL server binaries"
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs root (to run PostgreSQL as the postgres user)"
    if shutil.which("redis-server") is None:
        return "needs redis-server"
    return None


class Postgres:
    """A PostgreSQL cluster of the harness's own; never the shared server."""

    def __init__(self) -> None:
        reason = missing_requirement()
        if reason:
            raise HarnessUnavailableError(reason)
        self._bin = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])
        self.dir = Path(tempfile.mkdtemp(prefix="jobplane-chaos-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._ctl = [str(self._bin / "pg_ctl"), "-D", str(self.dir / "db")]
        self._ctl += ["-l", str(self.dir / "log"), "-w"]
        self._options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=300"
        )

    def start(self) -> None:
        self._run(str(self._bin / "initdb"), "-D", str(self.dir / "db"), "-A", "trust")
        self._run(*self._ctl, "-o", self._options, "start")

    def restart(self) -> None:
        self._run(*self._ctl, "-m", "fast", "-o", self._options, "restart")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run(*self._ctl, "-m", "immediate", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self, *args: str) -> None:
        runuser = shutil.which("runuser") or "runuser"
        subprocess.run(
            [runuser, "-u", "postgres", "--", *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )


class Redis:
    """A ``redis-server`` of the harness's own (``--save ''``): a restart starts it empty."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server") or "redis-server"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)

    def restart_empty(self) -> None:
        self.stop()
        self.start()


class ChaosProxy:
    """A TCP proxy in front of one server for one role. ``cut()`` partitions the role: nothing
    crosses and new connections hang (bytes wait, as TCP retransmits them across a real
    partition) until ``heal()``; ``delay_s`` adds latency to every chunk."""

    def __init__(self, port: int) -> None:
        self._target_port = port
        self._server: asyncio.Server | None = None
        self._healed = asyncio.Event()
        self._healed.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.delay_s = 0.0
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def is_cut(self) -> bool:
        return not self._healed.is_set()

    def cut(self) -> None:
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        await self._healed.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(65536):
                await self._healed.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                sink.write(data)
                await sink.drain()
        sink.close()
