"""The scheduler's probe server: both replicas are ready, whichever leads."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.cli_helpers import free_port, spawn_cli, stop_all, wait_http_ok


async def test_leader_and_follower_are_both_ready(
    pg_database_url: str, redis_url: str, redis_prefix: str
) -> None:
    ports = [free_port(), free_port()]
    env = {
        "JOBPLANE_DATABASE_URL": pg_database_url,
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": redis_prefix,
        "JOBPLANE_HEALTH_HOST": "127.0.0.1",
    }
    procs = [spawn_cli("scheduler", "--health-port", str(port), **env) for port in ports]
    try:
        for port in ports:
            await asyncio.to_thread(wait_http_ok, f"http://127.0.0.1:{port}/healthz")
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 30
            while True:  # until one of them has won the lease
                answers = [await client.get(f"http://127.0.0.1:{p}/readyz") for p in ports]
                leaders = [a.json()["leader"] for a in answers]
                if any(leaders) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            # The definition cache, read-only: the leader's (its jobs by key), none on a follower.
            cached = [(await client.get(f"http://127.0.0.1:{p}/definitions")).json() for p in ports]
        assert [a.status_code for a in answers] == [200, 200]
        assert sorted(leaders) == [False, True]
        assert answers[0].json()["checks"]["postgres"]["ok"] is True
        assert [c["leader"] for c in cached] == leaders
        assert [c["definitions"] is None for c in cached] == [not lead for lead in leaders]
    finally:
        stop_all(procs, sig=signal.SIGTERM)
    assert [p.returncode for p in procs] == [0, 0]
