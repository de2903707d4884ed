"""The ``jobplane`` command as a user runs it."""

from __future__ import annotations

import asyncio
import importlib.metadata
import ipaddress
import json
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jobplane_cli.runtime import run_dev
from jobplane_cli.settings import DevSettings
from jobplane_scheduler.scheduler import Scheduler
from tests.cli_helpers import (
    JOBPLANE,
    ROOT,
    free_port,
    jobplane_env,
    run_cli,
    wait_http_ok,
)


def test_the_command_loads_without_collections_and_freezes_what_it_loaded() -> None:
    """The installed command starts from ``jobplane_cli.launch``: the command line (SQLAlchemy,
    pydantic, the core library) loads with the cyclic collector off, what it made is frozen,
    and the collector is on again for the command itself. Loaded the usual way, the same
    import runs the collector about 190 times."""
    [entry] = [
        e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "jobplane"
    ]
    assert entry.value == "jobplane_cli.launch:main"
    probe = (
        "import gc, sys\n"
        "from jobplane_cli.launch import load\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and runs.append(1))\n"
        "main = load()\n"
        "print(json.dumps([len(runs), gc.get_freeze_count(), gc.isenabled(),\n"
        "                  main.__module__, 'sqlalchemy' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import json\n" + probe],
        cwd=ROOT,
        env=jobplane_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    runs, frozen, enabled, module, loaded = json.loads(done.stdout)
    assert runs == 0
    assert frozen > 50_000  # the command line's modules and what they made
    assert enabled
    assert module == "jobplane_cli.main"
    assert loaded


def test_migrate_creates_the_schema_and_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/jp.db"
    first = run_cli("migrate", JOBPLANE_DATABASE_URL=url)
    assert first.returncode == 0, first.stderr
    assert "database schema at revision" in first.stderr
    again = run_cli("migrate", JOBPLANE_DATABASE_URL=url)
    assert again.returncode == 0, again.stderr


def test_a_database_migrate_cannot_upgrade_is_one_line(tmp_path: Path) -> None:
    """``jobplane migrate`` (and ``jobplane dev``, which migrates first) on a database a
    newer version migrated, or holding a table of another application's of a name the schema
    uses, printed Alembic's or SQLAlchemy's traceback (120-210 lines, exit 1); an in-memory
    SQLite database (each connection its own, empty) waited out the start-up timeout and
    then said to run `jobplane migrate`. One line each now, exit 2, nothing changed."""
    import sqlite3

    newer = tmp_path / "newer.db"
    assert run_cli("migrate", JOBPLANE_DATABASE_URL=f"sqlite:///{newer}").returncode == 0
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE alembic_version SET version_num = '0099'")
    shared = tmp_path / "shared.db"
    with sqlite3.connect(shared) as db:
        db.execute("CREATE TABLE workers (id INTEGER PRIMARY KEY)")
    for url, said in (
        (f"sqlite:///{newer}", "unknown to this version"),
        (f"sqlite:///{shared}", "table workers already exists (give Jobplane a database"),
        ("sqlite:///:memory:", "in-memory SQLite database, which lives only as long"),
        ("sqlite:///file:jp?mode=memory&cache=shared&uri=true", "in-memory SQLite database"),
    ):
        for command in (["migrate"], ["dev", "--app", "tests.apps.basic:app"]):
            result = run_cli(*command, JOBPLANE_DATABASE_URL=url, JOBPLANE_STARTUP_TIMEOUT_S="5")
            assert result.returncode == 2, (command, url, result.stderr[-2000:])
            [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
            assert said in line and "Traceback" not in result.stderr, result.stderr[-2000:]
    with sqlite3.connect(shared) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"workers"}  # the failed migration left nothing behind


def test_unreachable_database_is_one_line_not_a_traceback() -> None:
    result = run_cli(
        "worker",
        "--app",
        "tests.apps.basic:app",
        JOBPLANE_DATABASE_URL="postgresql://nobody@127.0.0.1:1/nowhere",
        JOBPLANE_STARTUP_TIMEOUT_S="0",
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert "127.0.0.1:1" in line


def test_unmigrated_database_says_to_migrate(tmp_path: Path) -> None:
    result = run_cli(
        "worker",
        "--app",
        "tests.apps.basic:app",
        JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/empty.db",
        JOBPLANE_STARTUP_TIMEOUT_S="0",
    )
    assert result.returncode == 2
    assert "run `jobplane migrate`" in result.stderr and "Traceback" not in result.stderr


def test_unreachable_redis_is_one_line(sqlite_database_url: str) -> None:
    # (A copy of the migrated template: `jobplane migrate` itself is tested above.)
    result = run_cli(
        "worker",
        "--app",
        "tests.apps.basic:app",
        JOBPLANE_DATABASE_URL=sqlite_database_url,
        JOBPLANE_REDIS_URL="redis://127.0.0.1:1/0",
        JOBPLANE_STARTUP_TIMEOUT_S="0",
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert any(ln.startswith("error:") and "127.0.0.1:1" in ln for ln in result.stderr.splitlines())


def test_bad_app_path_is_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "worker", "--app", "no.such.module:app", JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/x.db"
    )
    assert result.returncode == 2
    assert "cannot import app module" in result.stderr and "Traceback" not in result.stderr


def test_dev_runs_the_example_end_to_end(tmp_path: Path) -> None:
    result = run_cli(
        "dev",
        "--app",
        "examples.hello:app",
        "--trigger",
        'greet={"name": "Ada"}',
        "--trigger",
        "crunch",
        "--exit-when-done",
        JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/dev.db",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Hello, Ada." in result.stdout
    assert result.stdout.count("succeeded") >= 2
    assert "enqueued → processing → succeeded" in result.stdout


def test_readme_example_is_the_shop_file_and_runs(tmp_path: Path) -> None:
    """The README's example is examples/shop.py, unabridged, and it runs as the README says:
    the mailer resource is opened and closed by the hooks, the receipt is written, the sync
    job checkpoints its chunks."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A job, end to end") :]
    block = section[section.index("```python\n") + len("```python\n") : section.index("\n```")]
    assert block.strip() in (ROOT / "examples" / "shop.py").read_text()
    outbox = tmp_path / "outbox.jsonl"
    database = tmp_path / "shop.db"
    result = run_cli(
        "dev",
        "--app",
        "examples.shop:app",
        "--trigger",
        'send_receipt={"order_id": 7, "email": "a@b.c"}',
        "--trigger",
        "nightly_cleanup",
        "--exit-when-done",
        JOBPLANE_DATABASE_URL=f"sqlite:///{database}",
        SHOP_OUTBOX=str(outbox),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in outbox.read_text().splitlines()] == [
        {"to": "a@b.c", "subject": "Order 7"}
    ]
    with sqlite3.connect(database) as db:
        rows = dict(db.execute("SELECT job_key, checkpoint FROM job_instances").fetchall())
    assert json.loads(rows["nightly_cleanup"]) == {"chunks": 10}


def test_dev_reports_bad_trigger_arguments(tmp_path: Path) -> None:
    result = run_cli(
        "dev",
        "--app",
        "examples.hello:app",
        "--trigger",
        'greet={"name": 5}',
        "--exit-when-done",
        JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/dev.db",
    )
    assert result.returncode == 2
    assert "args.name" in result.stderr and "Traceback" not in result.stderr


def test_dev_serves_the_api_on_loopback_without_auth_and_says_so(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "dev.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [JOBPLANE, "dev", "--app", "examples.hello:app", "--api-port", str(port)],
            cwd=ROOT,
            env=jobplane_env(JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/dev.db"),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/healthz", timeout_s=60)
        jobs = httpx.get(f"http://127.0.0.1:{port}/api/v1/jobs", timeout=5)  # no token
        assert jobs.status_code == 200, jobs.text
        assert "greet" in {j["key"] for j in jobs.json()}
        assert _listening_addresses(port) == {"127.0.0.1"}
        said = log_path.read_text()
        assert f"dev API on http://127.0.0.1:{port} without authentication" in said, said
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()


def test_dev_with_its_api_port_taken_says_so_and_stops_cleanly(tmp_path: Path) -> None:
    """uvicorn exited from inside the API's task with its own status (3): the other roles were
    not stopped, and nothing but uvicorn's log line said why."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = run_cli(
            "dev",
            "--app",
            "examples.hello:app",
            "--api-port",
            str(port),
            JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/dev.db",
            timeout=120,
        )
    assert result.returncode == 2, result.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 and IPv6 addresses a socket listens on at ``port`` (Linux /proc/net)."""
    found: set[str] = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            found.add(str(ipaddress.ip_address(words)))
    return found


async def test_dev_ends_when_its_scheduler_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the worker was watched: a scheduler that died (an error it does not wait out) left
    the process up, its API answering ready, with no cron ticks, promotions or sweeps."""

    async def fails(self: Scheduler, stop: asyncio.Event) -> None:
        raise RuntimeError("the scheduler failed (injected)")

    monkeypatch.setattr(Scheduler, "run", fails)
    settings = DevSettings(database_url=f"sqlite:///{tmp_path}/dev.db")
    running = run_dev("examples.hello:app", settings, asyncio.Event(), [], exit_when_done=False)
    with pytest.raises(RuntimeError, match="injected"):
        await asyncio.wait_for(running, 60)
