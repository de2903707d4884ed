"""Every Redis key name Jobplane uses, in one place.

Each queue's keys share one hash tag (``{q:<queue>}``) so every multi-key command on a queue
stays in one Redis Cluster slot; each worker's pinned stream has its own tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jobplane.bus.envelope import Envelope
from jobplane.domain.options import PRIORITY_MAX, PRIORITY_MIN

GROUP = "workers"

#: Priority bands, highest first: (lowest priority of the band, band number).
BANDS: tuple[tuple[int, int], ...] = ((7, 0), (3, 1), (PRIORITY_MIN, 2))


def band_of(priority: int) -> int:
    """The stream band of a priority: 0 for 7-9 (high), 1 for 3-6, 2 for 0-2 (low). A priority
    out of range (a row stored before every way in checked it) takes the nearest band: it
    raised, and every leader that published the row stopped on it."""
    priority = min(max(priority, PRIORITY_MIN), PRIORITY_MAX)
    for lowest, band in BANDS:
        if priority >= lowest:
            return band
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests use a prefix each, so they never touch each other)."""

    prefix: str = "jobplane"

    def queue_stream(self, queue: str, band: int) -> str:
        return f"{self.prefix}:q:{{{queue}}}:b{band}"

    def queue_streams(self, queue: str) -> list[str]:
        """The band streams of ``queue``, highest priority first."""
        return [self.queue_stream(queue, band) for _, band in BANDS]

    def queue_of(self, stream: str) -> str | None:
        """The queue whose band stream ``stream`` is (``None`` for any other stream: a
        worker's own)."""
        head = f"{self.prefix}:q:{{"
        queue, sep, band = stream.removeprefix(head).rpartition("}:b")
        if not stream.startswith(head) or not sep or not band.isdigit():
            return None
        return queue

    def stream_of(self, queue: str, envelope: Envelope) -> str:
        """The stream ``envelope`` is published to: its pinned worker's, else its band's."""
        if envelope.pinned_worker is not None:
            return self.worker_stream(envelope.pinned_worker)
        return self.queue_stream(queue, band_of(envelope.priority))

    def dead_letter(self, queue: str) -> str:
        return f"{self.prefix}:q:{{{queue}}}:dead"

    def worker_stream(self, worker_id: str) -> str:
        return f"{self.prefix}:w:{{{worker_id}}}"

    def worker_dead_letter(self, worker_id: str) -> str:
        return f"{self.prefix}:w:{{{worker_id}}}:dead"

    def consumer_streams(self, worker_id: str, queues: Sequence[str]) -> dict[str, str]:
        """The streams a worker reads, highest priority first (its pinned stream, then each
        queue's bands), each mapped to the dead-letter stream of its undecodable entries."""
        streams = {self.worker_stream(worker_id): self.worker_dead_letter(worker_id)}
        for queue in queues:
            for key in self.queue_streams(queue):
                streams[key] = self.dead_letter(queue)
        return streams

    def pending_updates(self) -> str:
        """Hash of job key → version of definition edits not yet applied by every cache."""
        return f"{self.prefix}:defs:pending"

    def epoch_marker(self) -> str:
        """A value the leader writes once; its absence means Redis lost its data (flushed)."""
        return f"{self.prefix}:epoch"

    def events_channel(self) -> str:
        return f"{self.prefix}:events"
