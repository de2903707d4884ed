"""The ``jobplane`` command as a user runs it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from tests.cli_helpers import ROOT, run_cli


def test_migrate_creates_the_schema_and_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/jp.db"
    first = run_cli("migrate", JOBPLANE_DATABASE_URL=url)
    assert first.returncode == 0, first.stderr
    assert "database schema at revision" in first.stderr
    again = run_cli("migrate", JOBPLANE_DATABASE_URL=url)
    assert again.returncode == 0, again.stderr


def test_unreachable_database_is_one_line_not_a_traceback() -> None:
    result = run_cli(
        "worker",
        "--app",
        "tests.apps.basic:app",
        JOBPLANE_DATABASE_URL="postgresql://nobody@127.0.0.1:1/nowhere",
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
    )
    assert result.returncode == 2
    assert "run `jobplane migrate`" in result.stderr and "Traceback" not in result.stderr


def test_unreachable_redis_is_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/jp.db"
    assert run_cli("migrate", JOBPLANE_DATABASE_URL=url).returncode == 0
    result = run_cli(
        "worker",
        "--app",
        "tests.apps.basic:app",
        JOBPLANE_DATABASE_URL=url,
        JOBPLANE_REDIS_URL="redis://127.0.0.1:1/0",
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
