"""``jobplane api --workers N``: N processes serve one port under a supervisor that stops them
together, gracefully on SIGTERM, and stops the role when one of them dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cli_helpers import free_port, output_of, spawn_cli, stop_all, wait_http_ok

pytestmark = pytest.mark.timeout(120)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ")"
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _servers(pid: int) -> list[int]:
    """The API processes among ``pid``'s children (not multiprocessing's resource tracker)."""
    return [c for c in _children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _env(database_url: str, redis_url: str, prefix: str) -> dict[str, str]:
    return {
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_REDIS_URL": redis_url,
        "JOBPLANE_KEY_PREFIX": prefix,
        "JOBPLANE_AUTH_ENABLED": "false",
    }


def _start(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = spawn_cli("api", "--host", "127.0.0.1", "--port", str(port), "--workers", "2", **env)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/readyz", timeout_s=60)
    return proc, url


def test_two_processes_serve_and_stop_gracefully(
    pg_database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """And /metrics sums the processes' request figures: each process counted only its own,
    so scrapes, answered by one process or the other, saw the counters go back and forth."""
    env = _env(pg_database_url, redis_url, redis_prefix)
    proc, url = _start(env)
    try:
        servers = _servers(proc.pid)
        assert len(servers) == 2
        shared = {_environ(pid).get("PROMETHEUS_MULTIPROC_DIR") for pid in servers}
        [directory] = shared
        assert directory and Path(directory).is_dir()
        # A connection each, so that both processes answer.
        close = {"Connection": "close"}
        with httpx.Client(base_url=url, headers=close) as client:
            answers = [client.get("/api/v1/jobs").status_code for _ in range(20)]
            scrapes = [client.get("/metrics").text for _ in range(8)]
        assert set(answers) == {200}
        listed = [_requests(text, "/api/v1/jobs") for text in scrapes]
        assert listed == [20.0] * 8, listed
        scraped = [_requests(text, "/metrics") for text in scrapes]
        assert scraped == sorted(scraped) and scraped[-1] >= 6, scraped
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not Path(directory).exists()
    finally:
        stop_all([proc])


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if b"=" in item)


def _requests(text: str, route: str) -> float:
    """jobplane_api_requests_total of GET ``route`` answered 200 (0 before the first)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "jobplane_api_requests_total"
        and sample.labels == {"method": "GET", "route": route, "status": "200"}
    )


def test_a_dead_process_stops_the_role(
    pg_database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """One API process is SIGKILLed: the supervisor stops the other and exits non-zero, so
    the orchestrator restarts the whole role instead of leaving it at half capacity."""
    env = _env(pg_database_url, redis_url, redis_prefix)
    proc, _ = _start(env)
    try:
        servers = _servers(proc.pid)
        os.kill(servers[0], signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
        time.sleep(0.2)
        assert not Path(f"/proc/{servers[1]}").exists()
        # Which one, and how: it exited 1 and said nothing.
        assert "ended by itself (exit code -9): stopping the others" in output_of(proc)
    finally:
        stop_all([proc])


def test_the_processes_stop_when_their_supervisor_is_killed(
    pg_database_url: str, redis_url: str, redis_prefix: str
) -> None:
    """SIGKILL of the supervisor (an orchestrator's last resort, an OOM kill) left both API
    processes serving the port, orphans that nothing would stop; each now sees its supervisor
    gone and stops itself, gracefully."""
    env = _env(pg_database_url, redis_url, redis_prefix)
    proc, _ = _start(env)
    try:
        servers = _servers(proc.pid)
        assert len(servers) == 2
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in servers)
    finally:
        stop_all([proc])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped by init, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _sleeps_or_fails(fails: bool) -> None:
    if fails:
        sys.exit(2)
    time.sleep(60)


def test_the_supervisor_exits_with_the_code_of_the_process_that_failed() -> None:
    """The processes stopped because another failed may be killed by that stop: the exit
    code was the first of the list's failures (1 for a killed one) rather than the failed
    process's own (2: a setting, an unreachable database), one run in a few."""
    from jobplane.serving import supervise

    assert supervise(_sleeps_or_fails, [(False,), (True,)], grace_s=5) == 2
