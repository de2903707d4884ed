"""procrastinate on Postgres (its own database, created and dropped here): two
``procrastinate worker`` processes; every job stays a row, with its status events."""

from __future__ import annotations

import os
from collections.abc import Sequence
from importlib.metadata import version

import procrastinate
import psycopg
from psycopg.conninfo import make_conninfo

from bench.peers.adapters import harness, probe

ADMIN_URL = os.environ.get("PEERS_POSTGRES_URL", "")
DATABASE = f"peers_procrastinate_{os.environ.get('PEERS_RUN_ID', 'x')}"
URL = make_conninfo(ADMIN_URL, dbname=DATABASE) if ADMIN_URL else ""

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=URL))


@app.task(name="noop")
async def noop(sent: float) -> None:
    probe.record(sent)


class Client:
    label = ""
    in_flight = None
    has_bulk = True

    async def single(self, sent: float) -> None:
        await noop.defer_async(sent=sent)

    async def bulk(self, count: int) -> None:
        await noop.batch_defer_async(*({"sent": 0.0} for _ in range(count)))


class System(harness.NoWorkerEnv):
    name = "procrastinate"
    version = version("procrastinate")
    keeps = "each job's row and status events, in Postgres"
    notes: Sequence[str] = ()

    async def setup(self, config: harness.Config) -> Sequence[harness.Client]:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE}"'.encode())
        await app.open_async()
        await app.schema_manager.apply_schema_async()
        return [Client()]

    def worker_commands(self, config: harness.Config) -> list[list[str]]:
        command = [harness.installed("procrastinate")]
        command += ["--app", "bench.peers.adapters.procrastinate.app", "worker"]
        return [[*command, "--concurrency", str(config.concurrency)]] * 2

    async def teardown(self) -> None:
        await app.close_async()
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)'.encode())
