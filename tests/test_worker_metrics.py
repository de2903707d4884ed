"""The worker's pickup lag and its store and bus errors, by kind, move when they happen (real
Postgres and Redis; outages injected per call with FlakyStore and FlakyAckBus)."""

from __future__ import annotations

from jobplane.app import App
from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState as S
from jobplane.store.sql import SqlStore
from jobplane_worker.worker import Worker
from tests.test_poison import _refuse as refuse
from tests.worker_helpers import FlakyAckBus, FlakyStore, running_worker, settled

app = App("metrics")


@app.triggered(max_concurrency=10)
async def fine() -> int:
    return 1


@app.triggered()
async def refused() -> int:
    return 2  # its success is refused by a trigger in the database (see the test)


def _pickup_lag_s(instance: Instance) -> float:
    assert instance.started_at is not None, instance
    return (instance.started_at - (instance.published_at or instance.created_at)).total_seconds()


def _value(worker: Worker, name: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_pickup_lag_is_observed_per_claim(pg_store: SqlStore, redis_bus: Bus) -> None:
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, pg_store, redis_bus) as worker:
        made = [await dispatcher.trigger("fine") for _ in range(3)]
        await settled(pg_store, [i.id for i in made])
        assert _value(worker, "jobplane_worker_pickup_lag_seconds_count") == 3
        lag = _value(worker, "jobplane_worker_pickup_lag_seconds_sum")
    claimed = [await pg_store.get_instance(i.id) for i in made]
    # Each observation is the store's claim time minus its publication time (its creation time
    # when the claim came before the publication was marked: a fast worker wins that race).
    expected = sum(_pickup_lag_s(i) for i in claimed)
    assert abs(lag - expected) < 1e-3 and 0 <= lag < 3.0


async def test_store_and_bus_errors_are_counted_by_kind(pg_store: SqlStore, redis_bus: Bus) -> None:
    await refuse(
        pg_store, "refuse_success", "UPDATE", "NEW.job_key = 'refused' AND NEW.state = 'succeeded'"
    )
    flaky = FlakyStore(pg_store)
    flaky.fail_next["complete"] = 2
    bus = FlakyAckBus(redis_bus, ack_failures=1)
    dispatcher = Dispatcher(pg_store, redis_bus)
    async with running_worker(app, flaky, bus) as worker:
        ok = await dispatcher.trigger("fine")
        poison = await dispatcher.trigger("refused")
        done = await settled(pg_store, [ok.id, poison.id])
        errors = "jobplane_worker_backend_errors_total"
        assert _value(worker, errors, backend="store", kind="unavailable") == 2
        assert _value(worker, errors, backend="bus", kind="unavailable") == 1
        assert _value(worker, errors, backend="store", kind="refused") >= 1
        assert _value(worker, errors, backend="store", kind="conflict") == 0
    assert [i.state for i in done] == [S.SUCCEEDED, S.TERMINATED]  # parked
