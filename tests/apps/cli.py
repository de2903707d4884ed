"""Jobs of the client and CLI tests (tests/test_client_cli.py). The tests of that module share
one cluster: besides the basic ``echo`` and ``add_sync`` that most of them trigger, each test
that changes a definition (an edit, a pause) or counts a job's instances has a job of its own,
so that no test sees what another did."""

from __future__ import annotations

from jobplane import App
from tests.apps import basic

app = App("cli")

app.triggered(max_concurrency=50)(basic.echo)
app.triggered(max_concurrency=10)(basic.add_sync)
#: Edited, rolled back, paused and resumed by the edit/history test.
app.triggered(key="edit_me", max_concurrency=50)(basic.echo)
#: Paused (and left so) by the test of ``jobs ls`` filters.
app.triggered(key="pause_me", max_concurrency=50)(basic.echo)
#: Triggered only by the batch test, which counts its instances.
app.triggered(key="count_me", max_concurrency=10)(basic.add_sync)
#: Paused by a token named like rich markup, by the test of the CLI's tables.
app.triggered(key="markup_me", max_concurrency=10)(basic.echo)
