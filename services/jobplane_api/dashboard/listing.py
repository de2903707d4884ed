"""The instance list's filters, read once for the list and for the actions on everything
they select: the same form fields always select the same instances."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from jobplane.domain.models import InstanceFilter
from jobplane.domain.states import InstanceState
from jobplane.store.abc import ApiStore

#: The time ranges the list offers, in minutes (0: any time).
RANGES = {"": 0, "15m": 15, "1h": 60, "24h": 1440, "7d": 10080}


@dataclass(frozen=True, slots=True)
class Listing:
    filter: InstanceFilter
    #: The jobs the job filter offers (an app's only, in its scope).
    jobs: list[str]
    #: The filter as query parameters (to link to the same selection).
    query: list[tuple[str, str]]
    states: tuple[InstanceState, ...]

    def with_default_states(self, states: tuple[InstanceState, ...]) -> InstanceFilter:
        """The filter, selecting ``states`` when it names none (what an action applies to)."""
        return self.filter if self.states else replace(self.filter, states=states)


async def listing_of(
    store: ApiStore, *, state: Sequence[str], job: str, worker: str, since: str, app: str
) -> Listing:
    states = tuple(InstanceState(s) for s in state if s in set(InstanceState))
    minutes = RANGES.get(since, 0)
    now = await store.now()
    # An app's scope: its jobs' instances (none when it has no job).
    jobs = sorted(d.key for d in await store.list_definitions(app=app or None))
    selected = InstanceFilter(
        job_key=job.strip() or None,
        job_keys=tuple(jobs) if app else None,
        states=states,
        worker_id=worker.strip() or None,
        created_after=now - timedelta(minutes=minutes) if minutes else None,
    )
    query = [("state", s.value) for s in states]
    filters = (("job", job), ("worker", worker), ("since", since if minutes else ""), ("app", app))
    query += [(k, v) for k, v in filters if v]
    return Listing(selected, jobs, query, states)
