"""The one Markdown table of the peers' run, from the adapters' JSON rows (the contract is
``bench/peers/adapters/harness.py`` ``_row``), and the ratios of Jobplane to the best peer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]

#: Every key an adapter's row carries (``None`` where it does not apply).
FIELDS = (
    "system",
    "version",
    "client",
    "keeps",
    "notes",
    "drain_jobs",
    "drain_per_s",
    "drain_busy_per_s",
    "single_per_s",
    "single_calls",
    "in_flight",
    "in_flight_per_s",
    "bulk_per_s",
    "latency_rate",
    "latency_p50_ms",
    "latency_p99_ms",
    "rss_idle_mb",
    "rss_drained_mb",
    "worker_processes",
    "supervisor_mb",
    "supervisors",
)

HEADER = (
    "system",
    "keeps after a job ran",
    "drain jobs/s, from start · from 1st job",
    "single enqueue/s",
    "bulk enqueue/s",
    "latency p50 / p99 ms",
    "worker RSS MB, idle / drained",
)

HOME = "Jobplane"


def check(row: Row) -> Row:
    """The row if it has exactly the contract's keys; ValueError naming the difference."""
    missing = set(FIELDS) - row.keys()
    extra = row.keys() - set(FIELDS)
    if missing or extra:
        name = row.get("system")
        raise ValueError(f"row of {name!r}: missing {sorted(missing)}, extra {sorted(extra)}")
    return row


def _n(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "—"
    return f"{value:,.{digits}f}"


def _label(row: Row) -> str:
    label = f"{row['system']} {row['version']}"
    return f"{label} ({row['client']})" if row["client"] else label


def _single(row: Row) -> str:
    text = _n(row["single_per_s"])
    if row["in_flight_per_s"] is not None:
        text += f" ({row['in_flight']} in flight: {_n(row['in_flight_per_s'])})"
    return text


def _latency(row: Row) -> str:
    if row["latency_p50_ms"] is None:
        return "—"
    return f"{_n(row['latency_p50_ms'], 1)} / {_n(row['latency_p99_ms'], 1)}"


def _memory(row: Row) -> str:
    if row["rss_idle_mb"] is None:
        return "(same workers)"
    text = f"{_n(row['rss_idle_mb'])} / {_n(row['rss_drained_mb'])}"
    if row["supervisors"]:
        text += f" (+{_n(row['supervisor_mb'])} supervisor)"
    return text


def cells(row: Row) -> tuple[str, ...]:
    drain = "(same workers)"
    if row["drain_per_s"] is not None:
        drain = f"{_n(row['drain_per_s'])} · {_n(row['drain_busy_per_s'])}"
    return (
        _label(row),
        row["keeps"],
        drain,
        _single(row),
        "—" if row["bulk_per_s"] is None else _n(row["bulk_per_s"]),
        _latency(row),
        _memory(row),
    )


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def ratios(rows: Sequence[Row]) -> str:
    """Jobplane (Python API) against the best peer, per figure: "drain 1.25x taskiq"."""
    home = next((r for r in rows if r["system"] == HOME and not _is_rest(r)), None)
    peers = [r for r in rows if r["system"] != HOME]
    if home is None or not peers:
        return ""
    parts = []
    for key, what, higher_is_better in (
        ("drain_per_s", "drain", True),
        ("drain_busy_per_s", "drain from 1st job", True),
        ("single_per_s", "single enqueue", True),
        ("bulk_per_s", "bulk enqueue", True),
        ("latency_p50_ms", "latency p50", False),
        ("latency_p99_ms", "latency p99", False),
        ("rss_idle_mb", "idle RSS", False),
    ):
        known = [r for r in peers if r[key] is not None and not math.isnan(r[key])]
        if home[key] is None or not known:
            continue
        best = (max if higher_is_better else min)(known, key=lambda r: r[key])
        parts.append(f"{what} {home[key] / best[key]:.2f}x {best['system']}")
    return "Jobplane (Python API) ÷ best peer: " + ", ".join(parts)


def _is_rest(row: Row) -> bool:
    return "REST" in row["client"]


def notes(rows: Sequence[Row]) -> list[str]:
    return [f"{row['system']}: {note}" for row in rows for note in row["notes"]]
