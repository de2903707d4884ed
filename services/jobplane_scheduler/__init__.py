"""The scheduler role: leader election, exact cron firing, promotions, recovery sweeps."""

from __future__ import annotations
