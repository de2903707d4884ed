"""Log output of the roles: text for people, or JSON (one object per line) for collectors.

Every field a log call passes in ``extra`` (``action``, ``instance_id``, ``job_key``,
``attempt``…) becomes a key of the JSON object, beside the fields of the process (its role,
its worker id), so a collector can filter on them without parsing messages.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from jobplane.telemetry import current_trace_id


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every LogRecord has: anything else on a record came from ``extra`` (except
#: uvicorn's ``color_message``, its message again with terminal colours).
_STANDARD = set(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call passed in ``extra``."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, the process's ``static`` fields, the call's ``extra`` fields, ``trace_id``
    while a span is current (tracing on: a job's own lines, a trigger's), and ``exc`` (the
    formatted traceback) when there is one. A value JSON cannot hold is written as its
    ``str()``."""

    def __init__(self, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.static,
            **extra_fields(record),
        }
        trace_id = current_trace_id()
        if trace_id is not None:
            body["trace_id"] = trace_id
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            body["stack"] = self.formatStack(record.stack_info)
        return json.dumps(body, default=str, ensure_ascii=False)


def configure_logging(
    level: str, log_format: LogFormat, static: Mapping[str, Any] | None = None
) -> None:
    """Send every log record to stderr in ``log_format``, from ``level`` up (the role's
    libraries, uvicorn included, log through the root logger)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format is LogFormat.JSON:
        handler.setFormatter(JsonFormatter(static))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("alembic").setLevel(logging.WARNING)
