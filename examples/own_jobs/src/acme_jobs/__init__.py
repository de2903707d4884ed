"""An example of a user's own job package, deployed on the Jobplane image (see ../README.md)."""

from __future__ import annotations
