#!/usr/bin/env bash
# Create .venv (if needed) and install Jobplane from the lock file, reproducibly.
#   scripts/bootstrap.sh runtime   # what `make demo` needs
#   scripts/bootstrap.sh dev       # plus the test and lint tools
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-dev}"
lock="requirements/${kind}.lock"
[ -f "$lock" ] || { echo "bootstrap: no lock file $lock" >&2; exit 2; }
python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "bootstrap: Python >= 3.11 is needed ($python is $("$python" -V 2>&1))" >&2; exit 2; }
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=".venv/.installed-${kind}"
# Reinstall only when the lock or the project metadata changed.
if [ ! -f "$stamp" ] || [ "$lock" -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # (pip's warnings about index locations configured on this machine but absent are noise)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes \
    -r "$lock" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e . 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  touch "$stamp"
fi
# The project's own modules compiled to bytecode, as pip compiles what it installs and the image
# does (`compileall`): where PYTHONDONTWRITEBYTECODE is set, every process would otherwise
# compile them from source at start (0.1 s of a worker's start-up, docs/benchmarks.md).
.venv/bin/python -m compileall -q libs services bench examples > /dev/null
