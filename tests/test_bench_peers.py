"""The peers' harness without the peers: the row an adapter prints is the row the table reads,
the in-job probe counts and times across processes through its files, and the worker trees are
measured and stopped whole. Nothing is installed and nothing is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from bench.peers import table
from bench.peers.adapters import harness, probe
from bench.peers.adapters.processes import Memory, Workers

ROOT = Path(__file__).resolve().parent.parent


class _System:
    name = "Jobplane"
    version = "0.1.0"
    keeps = "every transition, in Postgres"
    notes: Sequence[str] = ("a note",)


def _rows() -> list[table.Row]:
    drain = (2000, 4.0, 2.0)
    memory = Memory(workers_mb=200.0, workers=2, supervisors_mb=0.0, supervisors=0)
    python = harness.ClientRow("Python API", single_calls=100, single_s=0.5, bulk_calls=1000)
    python.bulk_s, python.latency = 0.25, {"rate": 99.0, "p50_ms": 4.0, "p99_ms": 9.5}
    rest = harness.ClientRow("REST, `jobplane api`", single_calls=50, single_s=0.5, in_flight=16)
    rest.in_flight_per_s = 400.0
    system = _System()
    return [
        harness._row(system, python, 0, drain, memory, memory),
        harness._row(system, rest, 1, drain, memory, memory),
    ]


def test_an_adapters_rows_survive_json_and_make_the_table() -> None:
    rows = [table.check(row) for row in json.loads(json.dumps(_rows()))]
    peer = {**rows[0], "system": "saq", "client": "", "drain_per_s": 400.0, "latency_p50_ms": 2.0}

    lines = table.markdown([*rows, peer]).splitlines()

    assert lines[2] == (
        "| Jobplane 0.1.0 (Python API) | every transition, in Postgres | 500 · 1,000 | 200 "
        "| 4,000 | 4.0 / 9.5 | 200 / 200 |"
    )
    assert lines[3] == (
        "| Jobplane 0.1.0 (REST, `jobplane api`) | every transition, in Postgres "
        "| (same workers) | 100 (16 in flight: 400) | — | — | (same workers) |"
    )
    assert "drain 1.25x saq" in table.ratios([*rows, peer])
    assert "latency p50 2.00x saq" in table.ratios([*rows, peer])


def test_a_row_that_breaks_the_contract_is_refused() -> None:
    row = _rows()[0]
    del row["bulk_per_s"]
    with pytest.raises(ValueError, match="bulk_per_s"):
        table.check({**row, "surprise": 1})


_JOBS = """
import sys, time
from bench.peers.adapters import probe
for sent in (0.0, time.time() - 0.5, 0.0):
    probe.record(sent)
time.sleep(0.2)
"""


def test_the_probe_adds_up_the_jobs_of_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "PEERS_PROBE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    before = time.time()
    for _ in range(2):
        subprocess.run([sys.executable, "-c", _JOBS], env=env, check=True, timeout=60)

    totals = probe.read(str(tmp_path))

    assert totals.done == 6
    assert before <= totals.first <= totals.last <= time.time()
    latencies = [x for seen in totals.latencies.values() for x in seen]
    assert len(latencies) == 2
    assert all(0.5 <= x < 5 for x in latencies)


def test_worker_trees_are_measured_by_role_and_stopped_whole() -> None:
    # A supervisor (the shell) with two job processes under it, and a lone process.
    tree = "sleep 60 & sleep 60 & wait"
    workers = Workers([["sh", "-c", tree], ["sleep", "60"]], os.environ, str(ROOT))
    workers.start()
    try:
        deadline = time.monotonic() + 10
        while (memory := workers.memory()).workers < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (memory.workers, memory.supervisors) == (3, 1)
        assert memory.workers_mb > 0 and memory.supervisors_mb > 0
    finally:
        workers.stop()
    assert workers.memory() == Memory(0.0, 0, 0.0, 0)
