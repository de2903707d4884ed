"""The container image, checked without a Docker engine: the Dockerfile's rules, its health
check command run for real, and the worked example of a user's own job package."""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import ROOT, free_port, run_cli
from tests.deploy_helpers import unknown_env_names

DOCKERFILES = [ROOT / "Dockerfile", ROOT / "examples" / "own_jobs" / "Dockerfile"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in lines]


def test_the_image_is_multi_stage_locked_non_root_with_one_entrypoint() -> None:
    steps = instructions(ROOT / "Dockerfile")
    froms = [args for op, args in steps if op == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith("AS build")
    runs = " ".join(args for op, args in steps if op == "RUN")
    assert "--require-hashes" in runs and "requirements/runtime.lock" in runs
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [json.loads(args) for op, args in final if op == "ENTRYPOINT"] == [["jobplane"]]
    assert any(op == "HEALTHCHECK" for op, _ in final)
    copied = [args.split()[0] for op, args in final if op == "COPY" and "--from" not in args]
    assert copied == ["examples"]  # the example apps are in the image
    arg = next(args for op, args in steps if op == "ARG" and args.startswith("PYTHON_IMAGE="))
    assert "python:3.11-slim" in arg
    env = dict(
        item.split("=", 1) for op, args in final if op == "ENV" for item in shlex.split(args)
    )
    assert env["JOBPLANE_LOG_FORMAT"] == "json"  # containers log one JSON object per line
    assert unknown_env_names(list(env)) == []
    # The shop example writes its outbox where the read-only image can (a worker of it failed
    # to start: "Read-only file system: 'shop-outbox.jsonl'").
    assert env["SHOP_OUTBOX"].startswith("/tmp/")


def test_dockerignore_keeps_every_file_the_dockerfile_copies() -> None:
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negated = pattern.startswith("!")
            body = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
                result = not negated
        return result

    sources = [
        shlex.split(args)[0]
        for op, args in instructions(ROOT / "Dockerfile")
        if op == "COPY" and "--from" not in args
    ]
    assert sources and all((ROOT / s).exists() and not ignored(s) for s in sources), sources
    assert ignored(".venv") and ignored("tests") and ignored(".git")


@pytest.fixture
def http_ok() -> Iterator[str]:
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_the_health_check_command_fails_unless_healthz_answers(http_ok: str) -> None:
    [check] = [args for op, args in instructions(ROOT / "Dockerfile") if op == "HEALTHCHECK"]
    command = json.loads(check[check.index("CMD") + 3 :])
    assert command[0] == "python"

    def run(url: str) -> int:
        env = {"HEALTHCHECK_URL": url, "PATH": str(Path(sys.executable).parent)}
        return subprocess.run([sys.executable, *command[1:]], env=env, timeout=30).returncode

    assert run(f"{http_ok}/healthz") == 0
    assert run(f"{http_ok}/nothing") != 0
    assert run(f"http://127.0.0.1:{free_port()}/healthz") != 0
    assert run("") == 0  # a role without a probe server (migrate)


def test_the_own_jobs_example_builds_from_the_image_and_runs(tmp_path: Path) -> None:
    """The worked example: its Dockerfile starts FROM the Jobplane image, and its package
    runs on a worker as the mounted way runs it (on PYTHONPATH)."""
    steps = instructions(ROOT / "examples" / "own_jobs" / "Dockerfile")
    assert steps[0] == ("ARG", "JOBPLANE_IMAGE=jobplane:0.1.0")
    assert steps[1] == ("FROM", "${JOBPLANE_IMAGE}")
    assert steps[-1][0] == "CMD" and "acme_jobs.jobs:app" in json.loads(steps[-1][1])
    result = run_cli(
        "dev",
        "--app",
        "acme_jobs.jobs:app",
        "--trigger",
        'build_report={"customer": "ada", "months": 2}',
        "--exit-when-done",
        JOBPLANE_DATABASE_URL=f"sqlite:///{tmp_path}/acme.db",
        JOBPLANE_QUEUES="default,reports",
        # The package first, then whatever path the tests run with (a checkout's own code).
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "examples" / "own_jobs" / "src"), os.environ.get("PYTHONPATH", "")]
        ),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "build_report" in result.stdout and "succeeded" in result.stdout
