"""Crashes in the roles' output: the rule that tells a crash from an error the role handled.

The roles log JSON, one object per line (``JOBPLANE_LOG_FORMAT=json``). An error the product
handles (a retry on an outage, a refused write it then records) is written on purpose, as a
record carrying a stable ``action`` field, often with its traceback in ``exc``: it is counted
by action, not a violation. A crash is what no handler wrote:

- a ``Traceback (most recent call last)`` on a line that is not a JSON record: the
  interpreter printed an exception nobody caught (the process's, a thread's, an isolated
  job's child process's);
- a record at ``CRITICAL``;
- a record at ``ERROR`` without an ``action``: written by a library or the runtime on an
  exception that escaped the product's handling (asyncio's "Task exception was never
  retrieved", uvicorn's "Exception in ASGI application"), or by a product handler of a case
  that must not happen at all.

The output a process wrote after the harness sent it SIGKILL is not judged: what its orphaned
children print as they die (an isolated job's child on its broken pipe) is the kill's doing.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

TRACEBACK = "Traceback (most recent call last)"
#: Lines of a raw traceback shown in a violation.
EXCERPT_LINES = 14


@dataclass
class Scan:
    #: One excerpt per crash found.
    crashes: list[str] = field(default_factory=list)
    #: Handled errors (records at WARNING or ERROR with an ``action``, or with a traceback),
    #: by level and action.
    handled: Counter[str] = field(default_factory=Counter)


def scan(role: str, text: str, scan_into: Scan | None = None) -> Scan:
    """Judge ``text``, the output of one process of ``role``, by the rule above."""
    found = scan_into if scan_into is not None else Scan()
    lines = text.splitlines()
    for n, line in enumerate(lines):
        record = _record(line)
        if record is None:
            if TRACEBACK in line:
                excerpt = _raw_excerpt(lines, n)
                found.crashes.append(f"{role}: uncaught exception printed:\n{excerpt}")
            continue
        level, action = record.get("level"), record.get("action")
        if level == "CRITICAL" or (level == "ERROR" and not action):
            exc = str(record.get("exc") or "")
            tail = "\n".join(exc.splitlines()[-6:])
            found.crashes.append(
                f"{role}: {level} {record.get('logger')}: {record.get('message')}"
                + (f"\n{tail}" if tail else "")
            )
        elif level in ("WARNING", "ERROR") or record.get("exc"):
            found.handled[f"{level} {action}"] += 1
    return found


def _record(line: str) -> dict[str, object] | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _raw_excerpt(lines: list[str], at: int) -> str:
    """The raw traceback starting at ``at``: up to the next JSON record, at most
    :data:`EXCERPT_LINES` lines (the last ones, which name the exception)."""
    end = at + 1
    while end < len(lines) and _record(lines[end]) is None and TRACEBACK not in lines[end]:
        end += 1
    shown = lines[at:end]
    if len(shown) > EXCERPT_LINES:
        shown = [shown[0], "  ...", *shown[-(EXCERPT_LINES - 2) :]]
    return "\n".join("    | " + line for line in shown)
