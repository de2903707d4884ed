"""What a running job sees of its attempt: ids, attempt number, a bound logger, cancellation."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID


class Cancellation:
    """A cancellation signal usable from async code (``await wait()``) and from sync code in a
    pool thread (``is_set``, ``wait_sync(timeout)``). Set by the worker, on the event loop."""

    def __init__(self) -> None:
        self._thread_event = threading.Event()
        self._async_event: asyncio.Event | None = None
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if self._thread_event.is_set():
            return
        self.reason = reason
        self._thread_event.set()
        if self._async_event is not None:
            self._async_event.set()

    def is_set(self) -> bool:
        return self._thread_event.is_set()

    async def wait(self) -> str | None:
        if self._async_event is None:
            self._async_event = asyncio.Event()
            if self._thread_event.is_set():
                self._async_event.set()
        await self._async_event.wait()
        return self.reason

    def wait_sync(self, timeout: float | None = None) -> bool:
        return self._thread_event.wait(timeout)


class _InstanceLogger(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = extra
        return f"[{extra['job_key']} {extra['instance_id']}] {msg}", kwargs


@dataclass
class JobContext:
    """Handed to a job function that asks for it (a parameter annotated ``JobContext``)."""

    instance_id: UUID
    job_key: str
    attempt: int
    scheduled_at: datetime | None
    worker_id: str
    cancellation: Cancellation = field(default_factory=Cancellation)
    logger: logging.LoggerAdapter[logging.Logger] = field(init=False)

    def __post_init__(self) -> None:
        self.logger = _InstanceLogger(
            logging.getLogger(f"jobplane.jobs.{self.job_key}"),
            {"instance_id": str(self.instance_id), "job_key": self.job_key},
        )

    @property
    def cancelled(self) -> bool:
        """True once the attempt should stop (cancel requested, timeout, shutdown, lease lost)."""
        return self.cancellation.is_set()
