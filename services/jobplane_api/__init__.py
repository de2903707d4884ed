"""The api role: REST v1, health and readiness, metrics."""

from __future__ import annotations
