"""The options form of a job's page and the changes between versions (pure functions; the
routes are in :mod:`jobplane_api.dashboard.jobs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobplane.domain.models import DefinitionVersion
from jobplane.domain.options import JobKind, JobOptions

#: The options the form edits, in its order: every job's, then a recurring job's.
COMMON = (
    "name",
    "description",
    "queue",
    "priority",
    "max_concurrency",
    "on_limit",
    "retries",
    "timeout_s",
    "disabled",
)
RECURRING = ("cron", "timezone", "misfire")
#: Options shown in a version's changes (everything a user can set).
SHOWN_IN_DIFF = (*COMMON, *RECURRING, "start_at", "end_at", "backoff", "misfire_grace_s")


def editable(kind: JobKind) -> tuple[str, ...]:
    return COMMON + RECURRING if kind is JobKind.RECURRING else COMMON


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(getattr(value, "value", value))


def edit_values(options: JobOptions) -> dict[str, str]:
    """The form's initial values: the options as text (a checkbox is "on" or "")."""
    return {name: _text(getattr(options, name)) for name in editable(options.kind)}


def changes_from_form(options: JobOptions, form: dict[str, str]) -> dict[str, Any]:
    """The options the form changed, as the API's edit takes them: only what differs from
    ``options`` (an option left as it was is not re-validated), typed by the options model
    (numbers from text are converted there, and refused there with the field named)."""
    current = edit_values(options)
    changed: dict[str, Any] = {}
    for name in editable(options.kind):
        value = form.get(name, "").strip() if name != "description" else form.get(name, "")
        if value == current[name]:
            continue
        if name == "description":
            # A browser sends a textarea's line breaks as CRLF: the same text is left as it
            # was, and a new one saved with the line breaks a docstring has.
            value = _lines(value)
            if value == _lines(current[name]):
                continue
        if name == "disabled":
            changed[name] = value == "on"
        elif name == "cron":
            changed[name] = value or None  # empty: manual trigger only
        else:
            changed[name] = value
    return changed


def _lines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@dataclass(frozen=True, slots=True)
class Change:
    option: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class VersionRow:
    version: DefinitionVersion
    changes: list[Change]


def versions_with_changes(history: list[DefinitionVersion]) -> list[VersionRow]:
    """Each version (newest first, as the store gives them) with what it changed against the
    version before it."""
    rows = []
    for n, version in enumerate(history):
        before = history[n + 1] if n + 1 < len(history) else None
        changes = []
        if before is not None:
            old, new = before.options.model_dump(), version.options.model_dump()
            for option in SHOWN_IN_DIFF:
                if old.get(option) != new.get(option):
                    changes.append(Change(option, _shown(old.get(option)), _shown(new.get(option))))
        rows.append(VersionRow(version, changes))
    return rows


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_text(v) or '—'}" for k, v in value.items())
    return _text(value) or ("off" if value is False else "—")
