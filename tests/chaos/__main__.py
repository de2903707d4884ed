"""``python -m tests.chaos --minutes N --seed S``: run the harness, print its report, exit 1 on
any violation (2 when the machine cannot run it)."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

from tests.chaos.harness import Harness, Report
from tests.chaos.servers import missing_requirement


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10, help="Minutes of faults.")
    parser.add_argument("--seed", type=int, default=None, help="Seed (default: a random one).")
    parser.add_argument("--rate", type=float, default=6.0, help="REST requests per second.")
    parser.add_argument("--report", type=Path, default=None, help="Also write the report here.")
    options = parser.parse_args()
    reason = missing_requirement()
    if reason:
        sys.stderr.write(f"cannot run: {reason}\n")
        return 2
    seed = options.seed if options.seed is not None else random.randrange(1_000_000)
    sys.stdout.write(f"seed {seed}\n")
    sys.stdout.flush()
    report = asyncio.run(_run(options.minutes * 60, seed, options.rate))
    text = report.render()
    sys.stdout.write(text + "\n")
    if options.report is not None:
        options.report.write_text(text + "\n")
    return 0 if report.ok else 1


async def _run(seconds: float, seed: int, rate: float) -> Report:
    async with Harness() as harness:
        return await harness.run(seconds, seed, rate_per_s=rate)


if __name__ == "__main__":
    sys.exit(main())
