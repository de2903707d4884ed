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


def storable_text(text: str) -> str:
    """``text`` with what a store cannot keep made visible: NUL as ``\\x00`` and a lone
    surrogate as ``\\udXXX``. Postgres' ``jsonb`` refuses both (the outcome was recorded as
    ``OutcomeNotStored``, the job's error type, message and traceback lost) while SQLite kept
    them: cleaned, both stores keep the same diagnostics."""
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
