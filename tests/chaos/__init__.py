"""Fault-injection harness: the whole system as real processes on servers of its own, under
load and overlapping faults drawn from a seed, then an invariant checker over the store.
Run it with ``python -m tests.chaos --minutes 10 --seed 7``."""

from __future__ import annotations
