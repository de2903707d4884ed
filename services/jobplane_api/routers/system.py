"""Workers, scheduler, stats, health, readiness and metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from jobplane.domain.models import InstanceFilter
from jobplane.domain.states import InstanceState
from jobplane.errors import UnavailableError
from jobplane_api.deps import BusDep, StoreDep
from jobplane_api.metrics import MetricsCache
from jobplane_api.problems import problem
from jobplane_api.schemas import (
    PROBLEM_RESPONSES,
    BucketOut,
    SchedulerOut,
    StatsOut,
    WorkerOut,
)
from jobplane_api.security import Viewer

logger = logging.getLogger(__name__)

router = APIRouter(tags=["system"], responses=PROBLEM_RESPONSES)


@router.get(
    "/api/v1/workers",
    summary="List workers",
    response_model=list[WorkerOut],
    dependencies=[Viewer],
)
async def list_workers(store: StoreDep) -> list[WorkerOut]:
    """Every registered worker with the instances it is running now."""
    running = await store.list_instances(
        InstanceFilter(states=(InstanceState.PROCESSING,)), limit=10_000
    )
    by_worker: dict[str, list[object]] = {}
    for i in running.items:
        by_worker.setdefault(i.worker_id or "", []).append(i.id)
    return [WorkerOut.of(w, by_worker.get(w.id, [])) for w in await store.list_workers()]  # type: ignore[arg-type]


@router.get(
    "/api/v1/scheduler",
    summary="Scheduler leader",
    response_model=SchedulerOut,
    dependencies=[Viewer],
)
async def scheduler(store: StoreDep) -> SchedulerOut:
    """Who leads, in which term, since when."""
    lease = await store.get_leader(0)
    if lease is None:
        return SchedulerOut(leader=None, term=None, since=None, expires_at=None)
    return SchedulerOut(
        leader=lease.holder, term=lease.term, since=lease.acquired_at, expires_at=lease.expires_at
    )


@router.get(
    "/api/v1/stats",
    summary="Instance counts and throughput",
    response_model=StatsOut,
    dependencies=[Viewer],
)
async def stats(store: StoreDep, job: str | None = None) -> StatsOut:
    """Instances in each state, and the attempts that succeeded or failed and the instances
    terminated per minute over the last hour and per hour over the last day (all jobs, or
    one). The last bucket of each series is the current, still filling one."""
    return StatsOut(
        by_state=await store.count_by_state(job),
        per_minute=[BucketOut.of(b) for b in await store.throughput(60, 60, job)],
        per_hour=[BucketOut.of(b) for b in await store.throughput(3600, 24, job)],
    )


@router.get("/healthz", summary="Liveness", tags=["health"])
async def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness", tags=["health"], response_model=None)
async def readyz(store: StoreDep, bus: BusDep) -> dict[str, str] | Response:
    """Postgres and Redis are reachable. The answer names what is down, never where it is
    (hosts and ports go to the log only: this route is open)."""
    for name, ping in (("database", store.ping), ("redis", bus.ping)):
        try:
            await ping()
        except UnavailableError as exc:
            logger.warning(
                "not ready: %s unavailable: %s", name, exc, extra={"action": "api.not_ready"}
            )
            return problem(503, "Not ready", f"{name}: unavailable")
    return {"status": "ready"}


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    tags=["health"],
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(store: StoreDep, request: Request) -> Response:
    """Instance counts by state and job, live workers (from the store), each queue
    stream's length, consumer-group lag and pending entries (from the bus), reused for
    ``JOBPLANE_METRICS_CACHE_S`` seconds; and this process's request count and latency by
    route and status, in the Prometheus text format."""
    cache: MetricsCache = request.app.state.metrics
    body, content_type = await cache.render(store, request.app.state.bus)
    return Response(body + request.app.state.request_metrics.render(), media_type=content_type)
