"""The message bus: Redis Streams in production, an in-process bus as the embedded default."""

from __future__ import annotations
