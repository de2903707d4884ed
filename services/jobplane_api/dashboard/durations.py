"""A job's duration chart: the last attempt of each of its latest ended instances, oldest to
newest, one bar each, scaled to the longest."""

from __future__ import annotations

from dataclasses import dataclass

from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane_api.dashboard.render import duration

#: How many ended instances the chart shows (read newest end first, by an index).
RUNS_SHOWN = 50
#: Drawing area, in SVG user units (the Overview's charts use the same).
CHART_W, CHART_H = 600, 90


@dataclass(frozen=True, slots=True)
class RunBar:
    x: float
    width: float
    height: float
    ok: bool
    href: str
    label: str


@dataclass(frozen=True, slots=True)
class DurationChart:
    bars: list[RunBar]
    longest_s: float
    shown: int

    @classmethod
    def of(cls, ended: list[Instance]) -> DurationChart:
        """``ended``: latest end first (as ``Store.recent_ends`` returns them). Instances that
        ended without starting (cancelled while waiting, misfire records) have no bar."""
        runs = [
            (i, (i.finished_at - i.started_at).total_seconds())
            for i in reversed(ended)
            if i.started_at is not None and i.finished_at is not None
        ]
        longest = max((s for _, s in runs), default=0.0)
        scale = CHART_H / longest if longest > 0 else 0.0
        step = CHART_W / max(len(runs), 1)
        bars = [
            RunBar(
                x=n * step + 1,
                width=max(step - 2, 1),
                height=max(seconds * scale, 1.0),
                ok=i.state is InstanceState.SUCCEEDED,
                href=f"/instances/{i.id}",
                label=f"{i.finished_at:%Y-%m-%d %H:%M:%S} UTC: {i.state.value} after "
                f"{duration(seconds)} (attempt {i.attempt})",
            )
            for n, (i, seconds) in enumerate(runs)
        ]
        return cls(bars, longest, len(runs))
