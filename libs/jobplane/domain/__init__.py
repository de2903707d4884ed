"""Pure domain: job kinds and options, instance states and transitions. No I/O here."""

from __future__ import annotations
