"""Stream lengths against the Enqueued count, sampled while the faults run.

An entry is published for an instance made Enqueued (and published again only when the leader
finds its entry gone, or stuck ``republish_after_s`` with a consumer that does not read); a
worker acknowledges and deletes every entry it reads, claiming the instance or finding it no
longer Enqueued. So at any moment the streams hold entries of Enqueued instances, plus entries
of instances that left Enqueued a moment ago and whose entry is being read (or waits, delivered
to a worker that is frozen or cut off, to be reclaimed by another after ``reclaim_idle_s``).
Two bounds follow, each checked at every sample:

- ``stream_entry_multiplied``: no instance has more than :data:`MAX_COPIES` entries at once
  (the first, and one republish per consumer that stopped reading it);
- ``stream_entry_stale``: no entry is left for an instance that left Enqueued more than
  :data:`STALE_AFTER_S` ago — past every fault's length plus the reclaim time, that entry is
  one nobody will read, so the streams would grow beyond the Enqueued count.

A worker's own (pinned) stream has one reader, that worker: while it is away (restarting, which
takes long on a busy machine) its entries wait for it, and it discards those of instances no
longer Enqueued when it is back. (The leader deletes the entries of the instances it gives
away from a gone worker's stream; one published by a racing trigger or publish just after
that still waits for the worker.) So an entry of a worker's stream is judged from the later of
the instance leaving Enqueued and the worker's process being ready, and not while the worker
is down; the end of the run checks every stream, these included.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import redis.asyncio as aioredis
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from jobplane.bus.envelope import Envelope
from jobplane.domain.states import InstanceState
from jobplane.errors import EnvelopeError
from jobplane.store.sql import SqlStore
from jobplane.store.tables import instance_transitions, job_instances

#: Entries one instance may have at once (see the module's docstring).
MAX_COPIES = 3
#: Seconds after leaving Enqueued by which an instance's entries must be gone: the longest
#: fault (a 7 s partition, a 6 s freeze) plus the reclaim idle time (3 s), twice over.
STALE_AFTER_S = 20.0
#: Seconds between samples.
EVERY_S = 5.0


@dataclass
class StreamWatch:
    redis_port: int
    store: SqlStore
    #: Seconds since a role's current process became ready, ``None`` while it is down.
    up_for: Callable[[str], float | None]
    prefix: str = "chaos"
    samples: int = 0
    #: Samples skipped because a server was down (restarting, by a fault).
    skipped: int = 0
    max_entries: int = 0
    max_enqueued: int = 0
    #: The most entries of instances not Enqueued seen in one sample (being read).
    max_not_enqueued: int = 0
    violations: list[tuple[str, str]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every :data:`EVERY_S` until ``stop`` is set. Stopped by the event, not by a
        cancel: a cancel that reaches the database driver mid-read can come out as its
        connection error, which this loop takes for a server restarting and goes on."""
        client = aioredis.Redis(port=self.redis_port, socket_timeout=3)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), EVERY_S)
                if stop.is_set():
                    return
                try:
                    await self.sample(client)
                except (aioredis.RedisError, OSError, SQLAlchemyError):
                    self.skipped += 1  # a server restarting (a fault): the next sample
        finally:
            await client.aclose()

    async def sample(self, client: aioredis.Redis) -> None:
        """Read every queue and pinned stream (not the dead letters), then the states of the
        instances they name: Postgres is read after Redis, so an instance seen Enqueued in
        Postgres was not yet acknowledged when its entry was read."""
        entries: Counter[uuid.UUID] = Counter()
        streams: dict[uuid.UUID, set[str]] = defaultdict(set)
        async for key in client.scan_iter(match=f"{self.prefix}:*", _type="stream"):
            name = key.decode() if isinstance(key, bytes) else str(key)
            if name.endswith(":dead"):
                continue
            for _, fields in await client.xrange(name) or []:
                if fields is None:  # an entry with no fields names no instance
                    continue
                with contextlib.suppress(EnvelopeError, KeyError, TypeError):
                    instance = Envelope.decode(fields[b"d"]).instance_id
                    entries[instance] += 1
                    streams[instance].add(name)
        states, left_at, enqueued, now = await self._states(list(entries))
        self.samples += 1
        self.max_entries = max(self.max_entries, entries.total())
        self.max_enqueued = max(self.max_enqueued, enqueued)
        not_enqueued = 0
        stamp = time.strftime("%H:%M:%S")
        for instance, n in entries.items():
            if n > MAX_COPIES:
                self.violations.append(
                    (
                        "stream_entry_multiplied",
                        f"{instance}: {n} entries at {stamp} in {sorted(streams[instance])}",
                    )
                )
            state = states.get(instance)
            if state == InstanceState.ENQUEUED.value:
                continue
            not_enqueued += n
            since = left_at.get(instance)
            age = (now - since).total_seconds() if since is not None else None
            workers = self._workers_of(streams[instance])
            if len(workers) == len(streams[instance]):  # only in workers' own streams
                for worker in workers:
                    up = self.up_for(worker)
                    age = None if up is None or age is None else min(age, up)
            if age is not None and age > STALE_AFTER_S:
                self.violations.append(
                    (
                        "stream_entry_stale",
                        f"{instance}: {n} entries at {stamp} in {sorted(streams[instance])}, "
                        f"{state} for {age:.0f} s",
                    )
                )
        self.max_not_enqueued = max(self.max_not_enqueued, not_enqueued)

    def _workers_of(self, streams: set[str]) -> list[str]:
        """The workers whose own stream is among ``streams`` (``<prefix>:w:{<id>}``)."""
        head = f"{self.prefix}:w:{{"
        return [s[len(head) : -1] for s in streams if s.startswith(head) and s.endswith("}")]

    async def _states(
        self, ids: list[uuid.UUID]
    ) -> tuple[dict[uuid.UUID, str], dict[uuid.UUID, datetime], int, datetime]:
        """Each instance's state and the time of its latest transition, the Enqueued count,
        and the database's clock."""
        i, t = job_instances.c, instance_transitions.c
        async with self.store.engine.connect() as conn:
            rows = await conn.execute(select(i.id, i.state).where(i.id.in_(ids)))
            states = {r.id: r.state for r in rows}
            rows = await conn.execute(
                select(t.instance_id, func.max(t.at))
                .where(t.instance_id.in_(ids))
                .group_by(t.instance_id)
            )
            left_at = {r[0]: r[1] for r in rows}
            enqueued = await conn.scalar(
                select(func.count()).where(i.state == InstanceState.ENQUEUED.value)
            )
            now = await conn.scalar(select(func.now()))
        assert isinstance(now, datetime)
        return states, left_at, int(enqueued or 0), now
