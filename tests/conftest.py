"""Shared fixtures. Real Postgres and real Redis, each test isolated; see tests/fixtures/.

The suite runs in parallel (``make pytest``: pytest-xdist, ``--dist loadgroup``). Every test
already has its own database and Redis key prefix, each worker its own template database and
port range; tests that must share a worker carry an ``xdist_group`` mark."""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "tests.fixtures.servers",
    "tests.fixtures.bus",
    "tests.fixtures.store",
    "tests.fixtures.dashboard",
    "tests.fixtures.dashboard_client",
]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow fault tests (servers of their own, clusters of processes, a minute of load)
    run one after another on one worker, never two at once beside the rest of the suite.
    In a parallel run they are handed out first: the longest share of one worker starts at
    once while the other workers take the rest, instead of starting a third of the way in."""
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    for item in slow:
        item.add_marker(pytest.mark.xdist_group("slow"))
    # Then the other long ones (marked ``long``), so that the run does not end with one worker
    # still in a long test while the other has nothing left.
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order
        first = set(slow)
        long = [i for i in items if i not in first and i.get_closest_marker("long") is not None]
        first.update(long)
        items[:] = slow + long + [item for item in items if item not in first]
