"""The ``jobplane`` command's entry point: the command line loads without the cyclic garbage
collector.

Loading ``jobplane_cli.main`` (and with it SQLAlchemy, pydantic and the core library) makes
about 130,000 objects the collector tracks; about 77,000 of them (the modules, their classes
and functions) live as long as the process. While they are made, the collector runs about 190
times (once over the whole heap). So the collector is off while they load, and they are then
frozen (``gc.freeze``): later collections never walk them either. The import's garbage (about
50,000 small objects) stays, frozen: a collection to free it first took 97 ms, and the idle
RSS did not change without it. A role freezes what its own start adds once it is up
(:func:`jobplane.startup.freeze_startup_heap`). A worker's start, from the process to its
registration, took about 14 % less (docs/benchmarks.md, "Start-up").

This module imports nothing of the project at its top, so that the collector is off before
any of it loads.
"""

from __future__ import annotations

import gc
from collections.abc import Callable


def load() -> Callable[[], None]:
    """Import the command line with the collector off, freeze what that made, turn the
    collector back on, and return the command line's entry point."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from jobplane_cli.main import main as cli_main
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
    return cli_main


def main() -> None:
    load()()
