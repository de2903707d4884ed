"""The pure domain: transition table, option validation, backoff, cron."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import pytest

from jobplane.cron import next_fire_times
from jobplane.domain.options import Backoff, BackoffKind, JobOptions
from jobplane.domain.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    InstanceState,
    can_transition,
    check_transition,
    sources_of,
)
from jobplane.errors import IllegalTransitionError, InvalidOptionsError
from jobplane_worker.settings import WorkerSettings

S = InstanceState


def test_terminal_states_are_never_left() -> None:
    assert {S.SUCCEEDED, S.SKIPPED, S.CANCELLED, S.TERMINATED} == TERMINAL_STATES
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset()
        for target in S:
            with pytest.raises(IllegalTransitionError):
                check_transition(state, target)


@pytest.mark.parametrize(
    ("from_state", "to_state"),
    [
        (None, S.SCHEDULED),
        (None, S.ENQUEUED),
        (None, S.SKIPPED),
        (S.SCHEDULED, S.ENQUEUED),
        (S.SCHEDULED, S.CANCELLED),
        (S.ENQUEUED, S.PROCESSING),
        (S.ENQUEUED, S.SKIPPED),
        (S.ENQUEUED, S.CANCELLED),
        (S.ENQUEUED, S.TERMINATED),
        (S.PROCESSING, S.SUCCEEDED),
        (S.PROCESSING, S.FAILED),
        (S.PROCESSING, S.CANCELLED),
        (S.PROCESSING, S.ENQUEUED),
        (S.FAILED, S.SCHEDULED),
        (S.FAILED, S.ENQUEUED),
        (S.FAILED, S.TERMINATED),
    ],
)
def test_design_edges_are_allowed(from_state: S | None, to_state: S) -> None:
    assert can_transition(from_state, to_state)


@pytest.mark.parametrize(
    ("from_state", "to_state"),
    [
        (None, S.PROCESSING),
        (S.SCHEDULED, S.PROCESSING),
        (S.ENQUEUED, S.SUCCEEDED),
        (S.FAILED, S.SUCCEEDED),
    ],
)
def test_other_edges_raise_a_typed_error(from_state: S | None, to_state: S) -> None:
    with pytest.raises(IllegalTransitionError) as info:
        check_transition(from_state, to_state)
    assert info.value.to_state is to_state


def test_sources_of_enqueued() -> None:
    assert sources_of(S.ENQUEUED) == {S.SCHEDULED, S.PROCESSING, S.FAILED}


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"key": "a", "kind": "recurring", "cron": "* * * *"}, "cron"),
        ({"key": "a", "kind": "recurring", "cron": "61 * * * *"}, "cron"),
        ({"key": "a", "kind": "recurring", "cron": "* * * * * * *"}, "cron"),
        ({"key": "a", "kind": "recurring", "timezone": "Mars/Olympus"}, "timezone"),
        # Files of the zone database that are no zone: the host's own, and leftovers.
        ({"key": "a", "kind": "recurring", "timezone": "localtime"}, "timezone"),
        ({"key": "a", "kind": "recurring", "timezone": "posixrules"}, "timezone"),
        ({"key": "a", "kind": "recurring", "timezone": "right/UTC"}, "timezone"),
        ({"key": "a", "kind": "recurring", "timezone": "posix/Europe/Berlin"}, "timezone"),
        ({"key": "a", "kind": "recurring", "timezone": "UTC\n"}, "timezone"),
        # "$" matched before a final newline: a queue no worker could consume was accepted.
        ({"key": "a", "kind": "triggered", "queue": "mail\n"}, "queue"),
        ({"key": "job\n", "kind": "triggered"}, "key"),
        # A number was read as Unix seconds, or milliseconds above 2e10: 9999 became 1978.
        ({"key": "a", "kind": "recurring", "start_at": 253402300799}, "start_at"),
        ({"key": "a", "kind": "recurring", "end_at": "1700000000"}, "end_at"),
        ({"key": "a", "kind": "triggered", "max_concurrency": 0}, "max_concurrency"),
        # A boolean was read as 1 or 0: "retries": true saved one retry, and so on.
        ({"key": "a", "kind": "triggered", "retries": True}, "retries"),
        ({"key": "a", "kind": "triggered", "max_concurrency": True}, "max_concurrency"),
        ({"key": "a", "kind": "triggered", "timeout_s": True}, "timeout_s"),
        ({"key": "a", "kind": "triggered", "priority": False}, "priority"),
        (
            {"key": "a", "kind": "triggered", "max_unexpected_retries": True},
            "max_unexpected_retries",
        ),
        ({"key": "a", "kind": "recurring", "misfire_max": True}, "misfire_max"),
        ({"key": "a", "kind": "recurring", "misfire_grace_s": True}, "misfire_grace_s"),
        ({"key": "a", "kind": "triggered", "backoff": {"factor": True}}, "backoff.factor"),
        ({"key": "a", "kind": "triggered", "retries": -1}, "retries"),
        ({"key": "a", "kind": "triggered", "timeout_s": 0}, "timeout_s"),
        ({"key": "a", "kind": "triggered", "priority": 10}, "priority"),
        ({"key": "a", "kind": "triggered", "queue": "Bad Queue"}, "queue"),
        ({"key": "a", "kind": "triggered", "queue": "q{1}"}, "queue"),
        ({"key": "", "kind": "triggered"}, "key"),
        ({"key": "a", "kind": "triggered", "cron": "* * * * *"}, "cron"),
        ({"key": "a", "kind": "triggered", "backoff": {"kind": "sometimes"}}, "backoff.kind"),
        ({"key": "a", "kind": "triggered", "colour": "red"}, "colour"),
        (
            {
                "key": "a",
                "kind": "recurring",
                "start_at": datetime(2027, 1, 1, tzinfo=UTC),
                "end_at": datetime(2026, 1, 1, tzinfo=UTC),
            },
            "end_at",
        ),
        ({"key": "a", "kind": "recurring", "start_at": datetime(2027, 1, 1)}, "start_at"),
    ],
)
def test_invalid_options_name_the_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidOptionsError) as info:
        JobOptions.parse(**options)
    assert info.value.field == field
    assert info.value.reason


def test_defaults_follow_the_design() -> None:
    opts = JobOptions.parse(key="report", kind="triggered")
    assert opts.max_concurrency == 1 and opts.on_limit == "skip"
    assert opts.retries == 0 and opts.max_unexpected_retries == 3
    assert opts.timeout_s == 3600 and opts.name == "report" and opts.queue == "default"


def test_key_and_kind_are_immutable() -> None:
    opts = JobOptions.parse(key="report", kind="triggered")
    assert opts.edited(retries=4).retries == 4
    with pytest.raises(InvalidOptionsError) as info:
        opts.edited(key="other")
    assert info.value.field == "key"


def test_cron_is_normalised_and_six_fields_mean_seconds() -> None:
    opts = JobOptions.parse(key="t", kind="recurring", cron="* *  * * *   */15")
    assert opts.cron == "* * * * * */15"
    fires = next_fire_times(opts.cron, "UTC", datetime(2026, 1, 1, tzinfo=UTC), 3)
    assert [f.second for f in fires] == [15, 30, 45]


def test_backoff() -> None:
    assert Backoff(kind=BackoffKind.NONE).delay_for(3) == 0
    assert Backoff(kind=BackoffKind.FIXED, delay_s=5, jitter=False).delay_for(4) == 5
    exp = Backoff(delay_s=1, factor=2, max_delay_s=10, jitter=False)
    assert [exp.delay_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 10]
    jittered = Backoff(delay_s=4, jitter=True)
    assert jittered.delay_for(1, random_fraction=0.5) == 2
    # Growth past any float (1000.0 ** 103, 2.0 ** 1024) is past any cap, not an error.
    steep = Backoff(delay_s=1, factor=1000, max_delay_s=60, jitter=False)
    assert steep.delay_for(104) == steep.delay_for(2**31 - 1) == 60
    assert Backoff(delay_s=1, max_delay_s=60, jitter=False).delay_for(1025) == 60
    assert Backoff(delay_s=0, factor=1000, jitter=False).delay_for(104) == 0


def test_default_worker_ids_are_unique_per_process_and_overridable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("JOBPLANE_WORKER_ID", raising=False)
    one, two = WorkerSettings().worker_id, WorkerSettings().worker_id
    assert one != two and one.rsplit("-", 2)[1] == str(os.getpid())
    monkeypatch.setenv("JOBPLANE_WORKER_ID", "pod-7")
    assert WorkerSettings().worker_id == "pod-7"
