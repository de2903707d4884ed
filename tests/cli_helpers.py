"""Run the real ``jobplane`` command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBPLANE = str(Path(sys.executable).parent / "jobplane")


def jobplane_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env.update(overrides)
    return env


def run_cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JOBPLANE, *args],
        cwd=ROOT,
        env=jobplane_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def spawn_cli(*args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [JOBPLANE, *args],
        cwd=ROOT,
        env=jobplane_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
