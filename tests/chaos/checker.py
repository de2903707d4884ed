"""The invariant checker: reads the store after the quiet period and lists, per invariant, every
instance that breaks it (with its history). Each list must be empty."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from jobplane.domain.states import TERMINAL_STATES, InstanceState, can_transition
from jobplane.store.sql import SqlStore
from jobplane.store.tables import instance_transitions, job_definitions, job_instances
from tests.apps.chaos import TICKS, UNSTOPPABLE

S = InstanceState
Transition = tuple[int, S | None, S, int | None]  # seq, from, to, claim token
#: The reason a Processing → Failed carries when the attempt timed out.
TIMEOUT_REASON = "timeout"


@dataclass
class Findings:
    """Violations by invariant (each entry names the instance and shows its history), and
    instances by final state."""

    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    states: Counter[str] = field(default_factory=Counter)
    #: Attempts recorded Failed on timeout whose code ran on, holding their slot (runaways).
    runaways_held: int = 0

    def add(self, invariant: str, detail: str) -> None:
        self.violations[invariant].append(detail)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.violations.values())


@dataclass(frozen=True)
class Run:
    """One attempt's code running, as the job noted it (wall clock); ``end`` is ``None`` when
    its process died first."""

    instance: str
    attempt: int
    worker: str
    start: float
    end: float | None
    job: str = ""


#: Seconds two copies may seem to overlap by: the job notes its end a little after it stops.
OVERLAP_TOLERANCE_S = 0.2


def read_runs(path: Path) -> list[Run]:
    """The runs noted in ``path`` (``tests/apps/chaos.py``'s ``recorded``)."""
    starts: dict[tuple[str, int, str], float] = {}
    ends: dict[tuple[str, int, str], float] = {}
    if not path.exists():
        return []
    jobs: dict[tuple[str, int, str], str] = {}
    for line in path.read_text().splitlines():
        what, instance, attempt, worker, job, at = line.split()
        who = (instance, int(attempt), worker)
        (starts if what == "start" else ends)[who] = float(at)
        jobs[who] = job
    return [Run(*who, start, ends.get(who), jobs[who]) for who, start in starts.items()]


async def check(
    store: SqlStore,
    acks: dict[str, str],
    now: datetime | None = None,
    *,
    runs: Sequence[Run] = (),
    frozen: Sequence[tuple[str, float, float]] = (),
) -> Findings:
    """Check every invariant; ``acks`` maps each acknowledged instance id to its job key,
    ``runs`` are the attempts the jobs noted, ``frozen`` the (worker, from, to) wall-clock
    windows in which the harness had a worker stopped (SIGSTOP)."""
    found = Findings()
    async with store.engine.connect() as conn:
        instances = {str(r.id): r._mapping for r in await conn.execute(select(job_instances))}
        history: dict[str, list[Transition]] = defaultdict(list)
        steps: dict[int, Step] = {}
        t = instance_transitions.c
        rows = await conn.execute(
            select(
                t.seq,
                t.instance_id,
                t.from_state,
                t.to_state,
                t.claim_token,
                t.at,
                t.actor,
                t.reason,
            ).order_by(t.seq)
        )
        for seq, instance_id, from_state, to_state, token, at, actor, reason in rows:
            history[str(instance_id)].append(
                (seq, S(from_state) if from_state else None, S(to_state), token)
            )
            steps[seq] = Step(at.timestamp(), actor, reason)
        definitions = {r.key: r._mapping for r in await conn.execute(select(job_definitions))}
        db_now = now or await conn.scalar(select(func.now()))
    assert isinstance(db_now, datetime)
    _two_copies(found, runs, frozen, lambda i: _timeline(history.get(i, []), steps))
    for row in instances.values():
        found.states[row["state"]] += 1
    _acknowledged(found, acks, instances, db_now)
    _cron_ticks(found, instances.values())
    for instance_id, path in history.items():
        _legal_path(found, instance_id, path)
    _concurrency(found, instances, history, definitions, steps, runs)
    _attempts(found, instances.values(), definitions)
    _idempotency(found, instances.values())
    return found


def _two_copies(
    found: Findings,
    runs: Sequence[Run],
    frozen: Sequence[tuple[str, float, float]],
    timeline: Callable[[str], str] = lambda instance: "",
) -> None:
    """No two attempts of one instance ran at once: an attempt whose lease was lost (a
    partition) stopped before another began. A frozen worker cannot stop its code, so its
    attempts are left out (they may run on after it resumes, as a crash's would have), and so
    are the attempts of a job whose code cannot be stopped (a runaway runs on by design)."""
    by_instance: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        thawed = not any(
            w == run.worker and a <= (run.end or b) and run.start <= b for w, a, b in frozen
        )
        if run.end is not None and thawed and run.job not in UNSTOPPABLE:
            by_instance[run.instance].append(run)
    for instance, attempts in by_instance.items():
        for a, b in itertools.combinations(attempts, 2):
            overlap = min(a.end or 0, b.end or 0) - max(a.start, b.start)
            if overlap > OVERLAP_TOLERANCE_S:
                # With what the store recorded, so that one run's finding can be explained
                # after its servers are gone: the job, both runs, every step with its time.
                found.add(
                    "two_copies_at_once",
                    f"{instance}: attempt {a.attempt} on {a.worker} and attempt {b.attempt} "
                    f"on {b.worker} overlapped {overlap:.2f} s ({a.job}; runs "
                    f"{_span(a)} and {_span(b)}; steps {timeline(instance)})",
                )


def _span(run: Run) -> str:
    return f"{run.worker} #{run.attempt} {run.start:.3f} to {run.end or 0:.3f}"


def _timeline(path: Sequence[Transition], steps: dict[int, Step]) -> str:
    """An instance's steps with their times (epoch seconds, as the runs') and actors."""
    shown = []
    for seq, f, to, tok in path:
        step = steps.get(seq)
        at = f"{step.at:.3f} {step.actor}" if step is not None else "?"
        shown.append(f"{f or '[*]'}>{to}{f'#{tok}' if tok is not None else ''} {at}")
    return ", ".join(shown)


def _show(path: Iterable[Transition]) -> str:
    return " → ".join(
        f"{(f or '[*]')}>{to}#{tok}" if tok is not None else f"{(f or '[*]')}>{to}"
        for _, f, to, tok in path
    )


def _acknowledged(
    found: Findings, acks: dict[str, str], instances: dict[str, Any], now: datetime
) -> None:
    """No lost instance: every acknowledged trigger exists and is terminal, or still waits
    for a due time in the future; and nothing else is left unfinished after the quiet period."""
    for instance_id, job in acks.items():
        if instance_id not in instances:
            found.add("lost_acknowledged_trigger", f"{instance_id} ({job}) is not in the store")
    for instance_id, row in instances.items():
        state = S(row["state"])
        future = state is S.SCHEDULED and row["run_at"] is not None and row["run_at"] > now
        if state not in TERMINAL_STATES and not future:
            found.add(
                "not_terminal_after_quiet_period",
                f"{instance_id} ({row['job_key']}, {row['source']}) is {state}",
            )


def _cron_ticks(found: Findings, instances: Iterable[Any]) -> None:
    """Exactly one fire per tick, and no tick missing between a job's first and last one
    (a missed tick the misfire policy did not run is recorded Skipped, so it is present)."""
    ticks: dict[str, list[datetime]] = defaultdict(list)
    for row in instances:
        if row["source"] == "cron" and row["scheduled_at"] is not None:
            ticks[row["job_key"]].append(row["scheduled_at"])
    for key, times in ticks.items():
        for when, n in Counter(times).items():
            if n > 1:
                found.add("cron_tick_twice", f"{key} at {when.isoformat()}: {n} instances")
        if key not in TICKS:
            continue  # paused and resumed by the load: its gaps are legitimate
        ordered = sorted(set(times))
        for a, b in itertools.pairwise(ordered):
            if b - a != timedelta(seconds=1):
                found.add("cron_tick_missing", f"{key}: nothing between {a} and {b}")


def _legal_path(found: Findings, instance_id: str, path: list[Transition]) -> None:
    """Every history is a path of the state table starting at creation (so nothing leaves a
    terminal state), and each Processing → X carries its own attempt's claim token (no write
    from a stale claim was accepted)."""
    previous: S | None = None
    token: int | None = None
    for n, (_, from_state, to_state, claim) in enumerate(path):
        if from_state != previous or (n == 0) != (from_state is None):
            found.add("broken_history", f"{instance_id}: {_show(path)}")
            return
        if not can_transition(from_state, to_state):
            invariant = (
                "transition_out_of_terminal"
                if from_state is not None and from_state.is_terminal
                else "illegal_transition"
            )
            found.add(invariant, f"{instance_id}: {_show(path)}")
            return
        if from_state is S.PROCESSING and (claim is None or claim != token):
            found.add("stale_claim_write", f"{instance_id}: {_show(path)}")
        token = claim if to_state is S.PROCESSING else token
        previous = to_state


@dataclass(frozen=True)
class Step:
    """What the checker reads of a transition besides its states: when (the database's
    clock, epoch seconds), by whom (a worker id for an attempt's outcome), why."""

    at: float
    actor: str
    reason: str | None


def _concurrency(
    found: Findings,
    instances: dict[str, Any],
    history: dict[str, list[Transition]],
    definitions: dict[str, Any],
    steps: dict[int, Step],
    runs: Sequence[Run],
) -> None:
    """Replaying each job's history in commit order, no more attempts run at once than its
    max concurrency — counting a runaway as running until its code returned.

    An attempt is running from its Enqueued → Processing to its Processing → X, except a
    runaway: a Processing → Failed for a timeout whose code (as the job noted it, on that
    worker) ran on past that step holds its slot until the code's end. Its end is placed in
    the replay before the job's first step committed after it (the slot goes back only after
    the code returns, so a claim that used the slot legitimately comes after)."""
    per_job: dict[str, list[tuple[float, int]]] = defaultdict(list)
    ran_until = _runaway_ends(runs)
    held = 0
    for instance_id, path in history.items():
        row = instances.get(instance_id)
        if row is None:
            continue
        events = per_job[row["job_key"]]
        for seq, from_state, to_state, _ in path:
            if to_state is S.PROCESSING:
                events.append((seq, +1))
            elif from_state is S.PROCESSING:
                end = _runaway_end(instance_id, steps[seq], to_state, ran_until)
                if end is None:
                    events.append((seq, -1))
                else:
                    held += 1
                    events.append((-end, -1))  # placed below, once the job's steps are known
    for key, events in per_job.items():
        limit = definitions[key]["max_concurrency"]
        peak, at = _peak(events, steps)
        if peak > limit:
            found.add(
                "max_concurrency_exceeded",
                f"{key}: {peak} ran at once (runaways included), limit {limit}, "
                f"at transition seq {at}",
            )
    found.runaways_held = held


def _runaway_ends(runs: Sequence[Run]) -> dict[tuple[str, str], list[Run]]:
    ended: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        if run.end is not None:
            ended[(run.instance, run.worker)].append(run)
    return ended


def _runaway_end(
    instance_id: str, step: Step, to_state: S, ran_until: dict[tuple[str, str], list[Run]]
) -> float | None:
    """When the code of the attempt this step ended returned, if it ran on past the step (a
    runaway); else ``None``. A run of that instance on the step's worker that began before
    the step and ended after it is that attempt's code. (Code whose process died has no end:
    it stopped with its process, and its slot is given back by the dead-worker sweep.)"""
    if to_state is not S.FAILED or step.reason != TIMEOUT_REASON:
        return None
    ends = [
        run.end
        for run in ran_until.get((instance_id, step.actor), [])
        if run.end is not None and run.start <= step.at < run.end
    ]
    return max(ends) if ends else None


def _peak(events: list[tuple[float, int]], steps: dict[int, Step]) -> tuple[int, int]:
    """The most attempts running at once, and the seq of the step that reached it. Events
    are (seq, delta) for steps, or (-end, -1) for a runaway's end at wall time ``end``."""
    placed = sorted((seq, delta) for seq, delta in events if seq >= 0)
    times = [(steps[int(seq)].at, seq) for seq, _ in placed]
    for key, delta in events:
        if key < 0:
            # Just before the first of this job's steps (in seq order) committed after the end.
            after = next((seq for at, seq in times if at > -key), None)
            placed.append(((after - 0.5) if after is not None else float("inf"), delta))
    running = peak = 0
    peak_at = 0
    for seq, delta in sorted(placed):
        running += delta
        if running > peak:
            peak, peak_at = running, int(seq)
    return peak, peak_at


def _attempts(found: Findings, instances: Iterable[Any], definitions: dict[str, Any]) -> None:
    """Retries used stay within the job's retries, releases within max unexpected retries."""
    for row in instances:
        options = definitions[row["job_key"]]["options"]
        retries = int(options.get("retries", 0))
        unexpected = int(options.get("max_unexpected_retries", 3))
        if row["retries_used"] > retries or row["unexpected_retries_used"] > unexpected:
            found.add(
                "attempts_over_limit",
                f"{row['id']} ({row['job_key']}): retries {row['retries_used']}/{retries}, "
                f"unexpected {row['unexpected_retries_used']}/{unexpected}",
            )


def _idempotency(found: Findings, instances: Iterable[Any]) -> None:
    """An Idempotency-Key stands for one instance, however often it was replayed."""
    keys = Counter(row["idempotency_key"] for row in instances if row["idempotency_key"])
    for key, n in keys.items():
        if n > 1:
            found.add("idempotency_key_reused", f"key {key!r}: {n} instances")
