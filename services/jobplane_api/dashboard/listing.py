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
    #: Filter values that name no state or range ("bogus", "2d"): said, never read as "any"
    #: (an action on everything the list selects would then take every instance).
    unknown: tuple[str, ...] = ()

    def with_default_states(self, states: tuple[InstanceState, ...]) -> InstanceFilter:
        """The filter, selecting ``states`` when it names none (what an action applies to)."""
        return self.filter if self.states else replace(self.filter, states=states)


async def listing_of(
    store: ApiStore, *, state: Sequence[str], job: str, worker: str, since: str, app: str
) -> Listing:
    known = {s.value for s in InstanceState}
    named = [s.strip().lower() for s in state if s.strip()]
    states = tuple(dict.fromkeys(InstanceState(s) for s in named if s in known))
    unread = tuple(s for s in named if s not in known)
    unknown = unread + ((since,) if since not in RANGES else ())
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
    # (What it cannot read goes on with the filter: the actions on everything it selects
    # refuse it rather than read it as "any".)
    query = [("state", s.value) for s in states] + [("state", s) for s in unread]
    filters = (("job", job), ("worker", worker), ("since", since), ("app", app))
    query += [(k, v) for k, v in filters if v]
    return Listing(selected, jobs, query, states, unknown)
