"""The trigger path of two versions, interleaved: for a machine shared with other work.

    .venv/bin/python -m bench.trigger_ab BEFORE [AFTER] [--slices 12] [--slice-seconds 1.5]

``BEFORE`` and ``AFTER`` are commits (``AFTER`` defaults to the working tree), each exported
to a directory of its own and run from there with this environment's packages. Both versions
are started side by side, each on a fresh database and key prefix, then measured in turns of
``--slice-seconds`` (before, after, after, before, …), ``--slices`` each; the medians are
printed. While one is measured the other is idle, so both see the same load, give or take the
slice: the load of a shared machine changes by the second and a before/after of whole runs
measures the load more than the code.

1. ``Dispatcher.trigger``, 1 in flight (inside ``async with`` where the version has it, as
   the API uses it), in a process of each version: triggers/s, the CPU time of that process
   per trigger, p50 and p99.
2. REST: an API process of each version, triggered over plain keep-alive HTTP/1.1
   (``bench.trigger.RawTrigger``) with 16 and with 1 request in flight: triggers/s, the CPU
   time of the API process per request, p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from io import BytesIO
from pathlib import Path

from bench.api import api_process
from bench.common import ROOT, bus_for, cpu_seconds, environment, percentile
from bench.trigger import KEY, _define
from jobplane.dispatch import Dispatcher

#: Migrates the database named by ``sys.argv[1]`` with the code on ``PYTHONPATH``.
MIGRATE = (
    "import asyncio, sys; from jobplane.backends import migrate_database; "
    "asyncio.run(migrate_database(sys.argv[1]))"
)

#: (triggers/s, CPU ms per trigger, p50 ms, p99 ms) of one slice.
Slice = tuple[float, float, float, float]


def export(commit: str | None, into: Path) -> Path:
    """The tree of ``commit`` (the working tree's files when None) in a directory of its own."""
    if commit is None:
        return ROOT
    archive = subprocess.run(
        ["git", "archive", commit], cwd=ROOT, check=True, capture_output=True
    ).stdout
    target = into / commit
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def python_path(tree: Path) -> str:
    return os.pathsep.join(str(tree / part) for part in ("", "libs", "services"))


def process_tree(pid: int) -> list[int]:
    found = [pid]
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout.split()
    for child in children:
        found += process_tree(int(child))
    return found


async def timed(
    call: Callable[[], Awaitable[object]], seconds: float, in_flight: int, pids: list[int]
) -> Slice:
    """``call`` from ``in_flight`` loops for ``seconds``; CPU of ``pids`` (or of this
    process when empty) per call."""
    latencies: list[float] = []
    cpu_before = cpu_seconds(pids) if pids else time.process_time()
    started = time.perf_counter()
    deadline = started + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    elapsed = time.perf_counter() - started
    cpu = (cpu_seconds(pids) if pids else time.process_time()) - cpu_before
    count = len(latencies)
    return (
        count / elapsed,
        cpu * 1000 / count,
        percentile(latencies, 0.50) * 1000,
        percentile(latencies, 0.99) * 1000,
    )


async def dispatcher_child() -> None:
    """``--child``: a Dispatcher.trigger loop of this tree's version, one slice per line read."""
    async with environment() as (_url, prefix, store):
        await _define(store)
        bus = bus_for(prefix)
        try:
            async with AsyncExitStack() as stack:
                # Used as the API uses it (``async with``: its sends in the background). This
                # file runs with the measured tree's packages: an older Dispatcher may not be
                # a context manager, its sends then being done when trigger() returns.
                dispatcher = Dispatcher(store, bus)
                if hasattr(dispatcher, "__aenter__"):
                    dispatcher = await stack.enter_async_context(dispatcher)
                for _ in range(300):
                    await dispatcher.trigger(KEY)
                print("ready", flush=True)
                loop = asyncio.get_running_loop()
                while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
                    seconds = float(line)
                    measured = await timed(lambda: dispatcher.trigger(KEY), seconds, 1, [])
                    print(" ".join(str(v) for v in measured), flush=True)
        finally:
            await bus.close()


def bench_dispatchers(
    trees: dict[str, Path], slices: int, seconds: float
) -> dict[str, list[Slice]]:
    children: dict[str, subprocess.Popen[str]] = {}
    for name, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": python_path(tree)}
        child = subprocess.Popen(
            [sys.executable, __file__, "--child"],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {name} dispatcher did not start")
        children[name] = child
    found: dict[str, list[Slice]] = {name: [] for name in trees}
    try:
        for turn in range(slices):
            order = list(trees) if turn % 2 == 0 else list(trees)[::-1]
            for name in order:
                child = children[name]
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{seconds}\n")
                child.stdin.flush()
                a, b, c, d = (float(v) for v in child.stdout.readline().split())
                found[name].append((a, b, c, d))
    finally:
        for child in children.values():
            assert child.stdin is not None
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=60)
    return found


async def bench_apis(
    trees: dict[str, Path], slices: int, seconds: float
) -> dict[int, dict[str, list[Slice]]]:
    from bench.trigger import RawTrigger  # (this version's: the API processes are the trees')

    async with AsyncExitStack() as stack:
        apis: dict[str, tuple[str, list[int]]] = {}
        for name, tree in trees.items():
            ours = set(process_tree(os.getpid()))
            os.environ["PYTHONPATH"] = python_path(tree)  # what the API process runs
            url, prefix, store = await stack.enter_async_context(environment(migrate=False))
            # Migrated by the tree's own code: an older API refuses a newer schema.
            subprocess.run([sys.executable, "-c", MIGRATE, url], check=True)
            await _define(store)
            base = await stack.enter_async_context(api_process(url, prefix, 1))
            apis[name] = (base, [p for p in process_tree(os.getpid()) if p not in ours])
        found: dict[int, dict[str, list[Slice]]] = {}
        for in_flight in (16, 1):
            found[in_flight] = {name: [] for name in trees}
            async with AsyncExitStack() as connections:
                posts = {
                    name: await connections.enter_async_context(RawTrigger.open(base, in_flight))
                    for name, (base, _) in apis.items()
                }
                for name in trees:
                    await timed(posts[name].trigger, 1.0, in_flight, [])  # warm-up
                for turn in range(slices):
                    order = list(trees) if turn % 2 == 0 else list(trees)[::-1]
                    for name in order:
                        pids = apis[name][1]
                        measured = await timed(posts[name].trigger, seconds, in_flight, pids)
                        found[in_flight][name].append(measured)
        return found


def rows(path: str, measured: dict[str, list[Slice]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name, slices in measured.items():
        rate, cpu, p50, p99 = (statistics.median(column) for column in zip(*slices, strict=True))
        low, high = min(s[0] for s in slices), max(s[0] for s in slices)
        out.append(
            (
                f"{path}, {name}",
                f"{rate:,.0f} ({low:,.0f}-{high:,.0f})",
                f"{cpu:.3f}",
                f"{p50:.2f}",
                f"{p99:.2f}",
            )
        )
    return out


def main(ns: argparse.Namespace) -> None:
    from bench.api import print_table

    with tempfile.TemporaryDirectory() as scratch:
        trees = {
            "before": export(ns.before, Path(scratch)),
            "after": export(ns.after, Path(scratch)),
        }
        table = rows(
            "Dispatcher.trigger, 1 in flight",
            bench_dispatchers(trees, ns.slices, ns.slice_seconds),
        )
        apis = asyncio.run(bench_apis(trees, ns.slices, ns.slice_seconds))
        for in_flight, measured in apis.items():
            table += rows(f"REST (raw HTTP), 1 API process, {in_flight} in flight", measured)
    print_table(
        f"Trigger, before ({ns.before}) and after ({ns.after or 'working tree'}), medians of "
        f"{ns.slices} interleaved slices of {ns.slice_seconds} s",
        ("path, version", "triggers/s (min-max)", "CPU ms / trigger", "p50 ms", "p99 ms"),
        table,
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        asyncio.run(dispatcher_child())
        sys.exit(0)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", help="a commit")
    parser.add_argument("after", nargs="?", default=None, help="a commit (default: working tree)")
    parser.add_argument("--slices", type=int, default=12, help="per version and path")
    parser.add_argument("--slice-seconds", type=float, default=1.5)
    main(parser.parse_args())
