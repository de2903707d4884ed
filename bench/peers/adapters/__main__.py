"""Run one adapter: ``python -m bench.peers.adapters <name> '<config JSON>'``, in the system's
own interpreter. The adapter module is imported under its own name (never as ``__main__``), so
that its tasks are the ones its worker processes import."""

from __future__ import annotations

import importlib
import sys

from bench.peers.adapters import harness

if __name__ == "__main__":
    adapter = importlib.import_module(f"bench.peers.adapters.{sys.argv[1]}")
    harness.main(adapter.System())
