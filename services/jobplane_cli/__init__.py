"""The ``jobplane`` command: the composition root that wires the core library and the roles."""

from __future__ import annotations
