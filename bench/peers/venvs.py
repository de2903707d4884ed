"""One virtual environment per peer under ``.bench-peers/<name>/`` (git-ignored).

The peers cannot share one environment: arq pins ``redis<6`` while Celery's kombu needs
``redis>=6.1``. Each environment is installed from ``bench/peers/requirements/<name>.txt`` (the
peer's pinned version) and reinstalled only when that file changes; the harness itself needs
nothing but the standard library, so nothing else goes in.

    .venv/bin/python -m bench.peers.venvs celery arq     # install (or check) some of them
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".bench-peers"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements"


def requirements_of(name: str) -> Path:
    return REQUIREMENTS / f"{name}.txt"


def python_of(name: str) -> Path:
    """The interpreter of the peer's environment (installed or not)."""
    return CACHE / name / "bin" / "python"


def ensure(name: str) -> Path:
    """Create or refresh the environment of ``name``; returns its interpreter."""
    wanted = hashlib.sha256(requirements_of(name).read_bytes()).hexdigest()
    home = CACHE / name
    stamp = home / "requirements.sha256"
    if stamp.exists() and stamp.read_text().strip() == wanted and python_of(name).exists():
        return python_of(name)
    print(f"installing {name} into {home} ...", file=sys.stderr, flush=True)
    # The base interpreter, not this venv's: the peer's environment must not see our packages.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(home)], check=True)
    pip = [str(python_of(name)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, "-r", str(requirements_of(name))], stderr=subprocess.PIPE, text=True, check=False
    )
    # (pip's warnings about index locations configured on this machine but absent are noise)
    for line in done.stderr.splitlines():
        if "is ignored: it is neither a file nor a directory" not in line:
            print(line, file=sys.stderr)
    done.check_returncode()
    stamp.write_text(wanted + "\n")
    return python_of(name)


if __name__ == "__main__":
    for peer in sys.argv[1:]:
        print(ensure(peer))
