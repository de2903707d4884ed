"""Instance ids: time-ordered (UUIDv7) and true to the clock they were made by."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime

from jobplane.ids import ID_CLOCK_SKEW, id_floor, new_id


def test_ids_made_in_a_burst_sort_in_order_and_keep_the_clock_s_millisecond() -> None:
    """Faster than one a millisecond (200,000 in well under a second here), each id is greater
    than the one before and carries the millisecond it was made in, not a later one: ids that
    took the next millisecond whenever the last one was used ran 200 s ahead of the clock."""
    before_ms = time.time_ns() // 1_000_000
    made = [new_id() for _ in range(200_000)]
    after_ms = time.time_ns() // 1_000_000
    assert all(a < b for a, b in itertools.pairwise(made))
    assert made[0].version == made[-1].version == 7
    assert before_ms <= made[0].int >> 80 <= made[-1].int >> 80 <= after_ms


def test_a_moment_s_floor_bounds_the_ids_made_from_it() -> None:
    moment = datetime.fromtimestamp(time.time_ns() // 1_000_000 / 1000, UTC)
    made = new_id()
    assert id_floor(moment) <= made < id_floor(moment + ID_CLOCK_SKEW)
