"""Load over REST at a bounded rate: single and batch triggers (some delayed, some pinned),
Idempotency-Key replays and conflicting reuses, cancels, retries of terminal instances, pauses,
resumes and option edits of a recurring job. It records every acknowledged (201) instance for
the checker."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.apps.chaos import PAUSED_TICK

#: Triggered job keys and their weight in the mix (isolated children are costly: rare).
JOBS = {
    "fast": 6,
    "slow_async": 3,
    "sync_work": 3,
    "flaky": 2,
    "limited_skip": 2,
    "limited_wait": 2,
    "checkpointing": 2,
    "pinned": 1,
    "isolated": 1,
}
TERMINAL = {"succeeded", "skipped", "cancelled", "terminated"}


@dataclass
class Sent:
    """A trigger sent with an Idempotency-Key: what to replay, and the instance it made."""

    key: str
    job: str
    body: dict[str, Any]
    instance_id: str


@dataclass
class Load:
    base: str
    token: str
    workers: list[str]
    rng: random.Random
    rate_per_s: float = 6.0
    #: Acknowledged instance id → job key.
    acks: dict[str, str] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    ops: Counter[str] = field(default_factory=Counter)
    #: Idempotency broken as the API answered (a replay giving another instance, a conflicting
    #: reuse accepted).
    violations: list[str] = field(default_factory=list)
    _n: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(base_url=self.base, headers=headers, timeout=5) as client:
            while not stop.is_set():
                try:
                    await self._one(client)
                except httpx.TransportError:
                    self.ops["transport_error"] += 1  # api down or restarting: not acknowledged
                await asyncio.sleep(self.rng.expovariate(self.rate_per_s))

    async def _one(self, client: httpx.AsyncClient) -> None:
        roll = self.rng.random()
        if roll < 0.55 or not self.sent:
            await self._trigger(client)
        elif roll < 0.65:
            await self._batch(client)
        elif roll < 0.73:
            await self._replay(client)
        elif roll < 0.77:
            await self._conflict(client)
        elif roll < 0.87:
            await self._cancel(client)
        elif roll < 0.95:
            await self._retry(client)
        else:
            await self._pause_or_resume(client)

    def _next(self) -> int:
        self._n += 1
        return self._n

    def _body(self, job: str) -> dict[str, Any]:
        body: dict[str, Any] = {"args": {"value": self._next()}}
        if self.rng.random() < 0.2:
            body["delay_s"] = round(self.rng.uniform(0.5, 3), 2)
        if job == "pinned":
            body["pinned_worker"] = self.rng.choice(self.workers)
        return body

    async def _trigger(self, client: httpx.AsyncClient) -> None:
        job = self.rng.choices(list(JOBS), weights=list(JOBS.values()))[0]
        body, key = self._body(job), f"k{self._n}"
        answer = await client.post(
            f"/api/v1/jobs/{job}/instances", json=body, headers={"Idempotency-Key": key}
        )
        self.ops[f"trigger:{answer.status_code}"] += 1
        if answer.status_code == 201:
            made = answer.json()["id"]
            self.acks[made] = job
            self.sent.append(Sent(key, job, body, made))

    async def _batch(self, client: httpx.AsyncClient) -> None:
        items = []
        for _ in range(self.rng.randint(2, 10)):
            job = self.rng.choice(["fast", "sync_work", "flaky", "limited_wait"])
            items.append({"job_key": job, **self._body(job), "idempotency_key": f"b{self._n}"})
        answer = await client.post("/api/v1/instances/batch", json={"items": items})
        self.ops[f"batch:{answer.status_code}"] += 1
        if answer.status_code == 201:
            for item, made in zip(items, answer.json(), strict=True):
                self.acks[made["id"]] = item["job_key"]

    async def _replay(self, client: httpx.AsyncClient) -> None:
        first = self.rng.choice(self.sent)
        answer = await client.post(
            f"/api/v1/jobs/{first.job}/instances",
            json=first.body,
            headers={"Idempotency-Key": first.key},
        )
        self.ops[f"replay:{answer.status_code}"] += 1
        if answer.status_code in (200, 201) and answer.json()["id"] != first.instance_id:
            self.violations.append(
                f"replay of {first.key} gave {answer.json()['id']}, not {first.instance_id}"
            )

    async def _conflict(self, client: httpx.AsyncClient) -> None:
        first = self.rng.choice(self.sent)
        body = {**first.body, "args": {"value": -1}}
        answer = await client.post(
            f"/api/v1/jobs/{first.job}/instances", json=body, headers={"Idempotency-Key": first.key}
        )
        self.ops[f"conflict:{answer.status_code}"] += 1
        if answer.status_code in (200, 201):
            self.violations.append(f"conflicting reuse of {first.key} accepted: {answer.text}")

    async def _cancel(self, client: httpx.AsyncClient) -> None:
        """Cancel one of the latest triggers: most are still queued, delayed or running."""
        target = self.rng.choice(self.sent[-4:]).instance_id
        answer = await client.post(f"/api/v1/instances/{target}/cancel")
        self.ops[f"cancel:{answer.status_code}"] += 1

    async def _retry(self, client: httpx.AsyncClient) -> None:
        target = self.rng.choice(self.sent[-200:])
        state = await client.get(f"/api/v1/instances/{target.instance_id}")
        if state.status_code != 200 or state.json()["state"] not in TERMINAL:
            self.ops["retry:not_terminal"] += 1
            return
        answer = await client.post(f"/api/v1/instances/{target.instance_id}/retry")
        self.ops[f"retry:{answer.status_code}"] += 1
        if answer.status_code == 201:
            self.acks[answer.json()["id"]] = target.job

    async def _pause_or_resume(self, client: httpx.AsyncClient) -> None:
        action = self.rng.choice(["pause", "resume", "edit"])
        if action == "edit":
            await self._edit(client)
            return
        answer = await client.post(f"/api/v1/jobs/{PAUSED_TICK}/{action}")
        self.ops[f"{action}:{answer.status_code}"] += 1

    async def _edit(self, client: httpx.AsyncClient) -> None:
        """Edit the paused-and-resumed recurring job's options at the version just read (a
        409 when another edit won meanwhile)."""
        job = await client.get(f"/api/v1/jobs/{PAUSED_TICK}")
        if job.status_code != 200:
            self.ops[f"edit:read_{job.status_code}"] += 1
            return
        patch = {
            "version": job.json()["version"],
            "options": {"max_concurrency": self.rng.randint(5, 10)},
        }
        answer = await client.patch(f"/api/v1/jobs/{PAUSED_TICK}", json=patch)
        self.ops[f"edit:{answer.status_code}"] += 1
