"""Shared fixtures. Real Postgres and real Redis, each test isolated; see tests/fixtures/."""

from __future__ import annotations

pytest_plugins = [
    "tests.fixtures.servers",
    "tests.fixtures.bus",
    "tests.fixtures.store",
    "tests.fixtures.dashboard",
]
