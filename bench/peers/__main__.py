"""Jobplane beside Celery, Dramatiq, taskiq, saq, arq and procrastinate: one run, one harness,
one Markdown table.

    .venv/bin/python -m bench.peers [--jobs 20000] [--only taskiq,saq] [--quick]

Each peer is installed (once) into its own virtual environment under ``.bench-peers/<name>/``
from ``bench/peers/requirements/<name>.txt``; Jobplane runs from the project's ``.venv``. For
each system in turn the driver starts a private ``redis-server`` on a free port (nothing is
kept, nothing shared is touched), runs the system's adapter (``bench/peers/adapters/<name>.py``)
in that system's interpreter, and reads back its rows as JSON. Postgres systems (Jobplane,
procrastinate) create their own database on ``JOBPLANE_TEST_POSTGRES_URL`` and drop it after.
The phases are described in ``bench/peers/adapters/harness.py``.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict

from bench.common import POSTGRES_URL
from bench.peers import table, venvs
from bench.peers.adapters.harness import Config

SYSTEMS = ("jobplane", "taskiq", "dramatiq", "saq", "celery", "arq", "procrastinate")
CONCURRENCY = 256
ADAPTER_TIMEOUT_S = 1800


def config(jobs: int | None, quick: bool) -> Config:
    return Config(
        jobs=jobs or (2_000 if quick else 20_000),
        single_s=2.0 if quick else 5.0,
        rate=100.0,
        latency_s=2.0 if quick else 5.0,
        idle_s=2.0 if quick else 3.0,
        concurrency=CONCURRENCY,
        redis_url="",
        postgres_url=POSTGRES_URL,
    )


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A ``redis-server`` of this run on a free port, without persistence; killed after."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench.peers needs redis-server on PATH")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the private redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def run_adapter(name: str, python: str, base: Config) -> list[table.Row]:
    with private_redis() as redis_url:
        cfg = Config(**{**asdict(base), "redis_url": redis_url})
        env = {
            **os.environ,
            "PYTHONPATH": str(venvs.ROOT),
            "JOBPLANE_TEST_REDIS_URL": redis_url,
            "PEERS_REDIS_URL": redis_url,
            "PEERS_POSTGRES_URL": base.postgres_url,
            "PEERS_RUN_ID": uuid.uuid4().hex[:10],
        }
        command = [python, "-m", "bench.peers.adapters", name, json.dumps(asdict(cfg))]
        adapter = subprocess.Popen(
            command, cwd=venvs.ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            out, _ = adapter.communicate(timeout=ADAPTER_TIMEOUT_S)
        finally:
            if adapter.poll() is None:  # interrupted or timed out: let it stop its workers
                adapter.terminate()
                adapter.wait(timeout=60)
    if adapter.returncode != 0:
        raise RuntimeError(f"the {name} adapter exited with {adapter.returncode}")
    return [table.check(row) for row in json.loads(out.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, help="backlog of the drain (20,000; quick: 2,000)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--quick", action="store_true", help="2,000 jobs, 2 s phases")
    ns = parser.parse_args()
    names = ns.only.split(",") if ns.only else list(SYSTEMS)
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    # Install everything before measuring anything. Jobplane's own modules are compiled to
    # bytecode, as pip compiled each peer's when it installed it: with PYTHONDONTWRITEBYTECODE
    # set, Jobplane's processes would otherwise compile them from source at every start.
    for part in ("libs", "services", "bench"):
        compileall.compile_dir(venvs.ROOT / part, quiet=1)
    pythons = {n: sys.executable if n == "jobplane" else str(venvs.ensure(n)) for n in names}
    base = config(ns.jobs, ns.quick)
    rows: list[table.Row] = []
    failed: list[str] = []
    for name in names:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        try:
            rows += run_adapter(name, pythons[name], base)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            print(f"{name} failed: {exc}", file=sys.stderr, flush=True)
            failed.append(name)
    print(report(rows, base))
    if failed:
        print(f"\nNot measured (see the errors above): {', '.join(failed)}")
        sys.exit(1)


def report(rows: list[table.Row], cfg: Config) -> str:
    ratios = table.ratios(rows)
    lines = [
        table.markdown(rows),
        *(["", ratios] if ratios else []),
        "",
        f"No-op job; 2 worker processes; drain of {cfg.jobs:,} jobs enqueued first, clock from "
        "the first worker's start (or the first job's start) to the last job's start; "
        "single enqueue one call at a time, "
        f"awaited; bulk 1,000 per call; latency = enqueue call → job start at {cfg.rate:.0f} "
        f"jobs/s for {cfg.latency_s:.0f} s; RSS summed over the processes that run jobs.",
    ]
    lines += [f"- {note}" for note in table.notes(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
