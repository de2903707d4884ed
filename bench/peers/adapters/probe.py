"""What every benchmark job calls first: it counts the job and times its start, in the worker
process, and a background thread writes the totals to ``$PEERS_PROBE_DIR/<pid>.json`` every
10 ms for the harness to read. Standard library only (it runs inside every peer's environment).

A job enqueued with ``sent`` = ``time.time()`` at the enqueue call (the latency phase) adds
``start - sent`` to the latencies; drain jobs are sent with 0 and only counted.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass

FLUSH_S = 0.01

_lock = threading.Lock()
_pid = 0
_done = 0
_first = 0.0
_last = 0.0
_latencies: list[float] = []
_dirty = threading.Event()


def record(sent: float) -> None:
    """Count one job that starts now; ``sent`` > 0 also records its latency."""
    global _done, _first, _last
    now = time.time()
    if _pid != os.getpid():
        _start()
    with _lock:
        _first = _first or now
        _done += 1
        _last = now
        if sent > 0:
            _latencies.append(now - sent)
    _dirty.set()


def _start() -> None:
    """Reset the state (a forked child inherits its parent's) and start the writer thread."""
    global _pid, _done, _first, _last, _latencies
    with _lock:
        if _pid == os.getpid():
            return
        _pid, _done, _first, _last, _latencies = os.getpid(), 0, 0.0, 0.0, []
    threading.Thread(target=_write_forever, name="peers-probe", daemon=True).start()


def _write_forever() -> None:
    directory = os.environ["PEERS_PROBE_DIR"]
    path = os.path.join(directory, f"{os.getpid()}.json")
    while True:
        _dirty.wait()
        _dirty.clear()
        with _lock:
            state = {"done": _done, "first": _first, "last": _last, "latencies": _latencies}
            body = json.dumps(state)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(body)
        os.replace(tmp, path)
        time.sleep(FLUSH_S)


@dataclass(frozen=True)
class Totals:
    """Over every worker process: jobs started, ``time.time()`` of the first and the last,
    latencies in s by process (each process's list only grows, in the order of its jobs)."""

    done: int
    first: float
    last: float
    latencies: dict[str, list[float]]


def read(directory: str) -> Totals:
    done, first, last, latencies = 0, math.inf, 0.0, {}
    for name in os.listdir(directory):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(directory, name), encoding="utf-8") as src:
            state = json.load(src)
        done += state["done"]
        first = min(first, state["first"] or math.inf)
        last = max(last, state["last"])
        latencies[name] = state["latencies"]
    return Totals(done, first, last, latencies)
