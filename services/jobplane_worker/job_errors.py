"""What a job's exception says, whatever its code does.

A job may raise anything: an exception whose ``__str__`` raises, a ``BaseException`` of its own,
``SystemExit``. Its end is still recorded (an outcome, a log line), so the text of an exception
the worker did not make is always read through these, which never raise.
"""

from __future__ import annotations

import traceback


def exception_message(exc: BaseException) -> str:
    """``str(exc)``; a placeholder when the exception's own ``__str__`` fails."""
    try:
        return str(exc)
    except BaseException:  # job code: its __str__ may raise anything
        return f"<{type(exc).__name__}: str() failed>"


def exception_traceback(exc: BaseException) -> str:
    """The formatted traceback of ``exc`` (the traceback module already survives a failing
    ``__str__``; a broken ``__notes__`` or a cause chain of the job's making may not)."""
    try:
        return "".join(traceback.format_exception(exc))
    except BaseException:  # job code: as above
        return f"{type(exc).__name__}: {exception_message(exc)}\n(traceback not available)\n"


#: The most characters of a job's error recorded: its type name, its message, its traceback
#: (which repeats the message). A job's exception may carry megabytes (a whole response body,
#: a dump): kept whole, a 40 MB message was stored as an 84 MB row, read by every listing.
TYPE_MAX = 200
MESSAGE_MAX = 16_384
TRACEBACK_MAX = 65_536


def storable_text(text: str, limit: int) -> str:
    """``text`` with what a store cannot keep made visible: NUL as ``\\x00`` and a lone
    surrogate as ``\\udXXX``. Postgres' ``jsonb`` refuses both (the outcome was recorded as
    ``OutcomeNotStored``, the job's error type, message and traceback lost) while SQLite kept
    them: cleaned, both stores keep the same diagnostics. At most ``limit`` characters: a
    longer text keeps its beginning and its end (a traceback's last lines say where it was
    raised), the middle replaced by a line that says how much was cut."""
    if len(text) > limit:
        cut = len(text) - limit
        marker = f"\n[... {cut:,} characters cut ...]\n"
        keep = max(0, limit - len(marker))
        text = text[: keep // 2] + marker + text[len(text) - (keep - keep // 2) :]
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (an undecodable byte smuggled through)
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe(exc: BaseException) -> str:
    """``Type: message``, for a log line."""
    return f"{type(exc).__name__}: {exception_message(exc)}"
