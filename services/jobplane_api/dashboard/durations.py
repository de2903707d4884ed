"""A job's duration chart: the last attempt of each of its latest ended instances, oldest to
newest, one bar each. Drawn in the browser by uPlot (static/vendor/uplot) from the data
here; the same runs are listed in a table under the chart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane_api.dashboard.render import duration

#: How many ended instances the chart shows (read newest end first, by an index).
RUNS_SHOWN = 50


@dataclass(frozen=True, slots=True)
class Run:
    instance: Instance
    seconds: float

    @property
    def ok(self) -> bool:
        return self.instance.state is InstanceState.SUCCEEDED

    @property
    def href(self) -> str:
        return f"/instances/{self.instance.id}"

    @property
    def label(self) -> str:
        i = self.instance
        return (
            f"{i.finished_at:%Y-%m-%d %H:%M:%S} UTC: {i.state.value} after "
            f"{duration(self.seconds)} (attempt {i.attempt})"
        )


@dataclass(frozen=True, slots=True)
class DurationChart:
    runs: list[Run]
    longest_s: float

    @property
    def shown(self) -> int:
        return len(self.runs)

    @classmethod
    def of(cls, ended: list[Instance]) -> DurationChart:
        """``ended``: latest end first (as ``Store.recent_ends`` returns them). Instances that
        ended without starting (cancelled while waiting, misfire records) have no bar."""
        runs = [
            Run(i, (i.finished_at - i.started_at).total_seconds())
            for i in reversed(ended)
            if i.started_at is not None and i.finished_at is not None
        ]
        return cls(runs, max((r.seconds for r in runs), default=0.0))

    def data(self) -> dict[str, Any]:
        """What the page's script draws: a bar per run, succeeded and not succeeded in two
        series (``None`` where a run belongs to the other), and where each bar links."""
        return {
            "kind": "durations",
            "ends": [
                r.instance.finished_at.timestamp() for r in self.runs if r.instance.finished_at
            ],
            "series": [
                {
                    "label": "Succeeded",
                    "color": "ok",
                    "values": [r.seconds if r.ok else None for r in self.runs],
                },
                {
                    "label": "Not succeeded",
                    "color": "bad",
                    "values": [None if r.ok else r.seconds for r in self.runs],
                },
            ],
            "links": [r.href for r in self.runs],
            "unit": "s",
        }
