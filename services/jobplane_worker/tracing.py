"""The worker's spans. Claims and records are batched, each batch one statement for many
instances of many traces: each instance gets a span of its own, timed as the batch's
statement, in its own trace (the one its envelope carries). Nothing when tracing is off."""

from __future__ import annotations

import time
from collections.abc import Sequence
from uuid import UUID

from opentelemetry.context import Context

from jobplane import telemetry
from jobplane.bus.abc import Delivery
from jobplane.domain.models import Claim, Outcome
from jobplane.domain.states import InstanceState
from jobplane_worker.attempt import Attempt


def claim_spans(
    deliveries: Sequence[Delivery], claimed: Sequence[Claim], worker_id: str, began_ns: int
) -> dict[UUID, Context]:
    """A ``jobplane.claim`` span per claimed instance, child of the span that published it;
    returns each one's context, for the attempt's run and record."""
    tracer = telemetry.tracer()
    if tracer is None or not claimed:
        return {}
    ended_ns = time.time_ns()
    carried = {d.envelope.instance_id: d.envelope.trace for d in deliveries}
    traces: dict[UUID, Context] = {}
    for claim in claimed:
        instance = claim.instance
        span = tracer.start_span(
            "jobplane.claim",
            context=telemetry.context_of(carried.get(instance.id)),
            start_time=began_ns,
            attributes={
                "jobplane.instance_id": str(instance.id),
                "jobplane.job": instance.job_key,
                "jobplane.attempt": instance.attempt,
                "jobplane.worker_id": worker_id,
            },
        )
        span.end(end_time=ended_ns)
        traces[instance.id] = telemetry.context_with(span)
    return traces


def record_spans(
    batch: Sequence[tuple[Attempt, Outcome]], ended: dict[UUID, InstanceState], began_ns: int
) -> None:
    """A ``jobplane.record`` span per attempt of a recorded batch, child of its claim span."""
    tracer = telemetry.tracer()
    if tracer is None:
        return
    ended_ns = time.time_ns()
    for attempt, outcome in batch:
        state = ended.get(outcome.instance_id)
        span = tracer.start_span(
            "jobplane.record",
            context=attempt.trace,
            start_time=began_ns,
            attributes={"jobplane.state": state.value if state is not None else "refused"},
        )
        span.end(end_time=ended_ns)
