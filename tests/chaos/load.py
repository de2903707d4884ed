"""Load over REST and through the Python client (``jobplane.client.Client``), at a bounded
rate: single and batch triggers (some delayed, some pinned), Idempotency-Key replays and
conflicting reuses, cancels of queued and of running instances, retries of terminal instances,
pauses, resumes and option edits of a recurring job. Each request goes one way or the other at
random. It records every acknowledged instance (a 201, or a client call that returned one) for
the checker.

The client is the synchronous one, as a program would use it: it runs in a thread of its own
(it keeps a private event loop, which must not be the harness's)."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from jobplane.client import ApiError, Client
from jobplane.errors import JobplaneError
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
    "runaway": 1,
}
TERMINAL = {"succeeded", "skipped", "cancelled", "terminated"}


#: Jobs long enough to be running a moment after their trigger (cancels of running ones).
LONG = ("slow_async", "checkpointing")
#: Seconds after its trigger a long job is taken to be running.
RUNNING_AFTER_S = (0.4, 1.2)


@dataclass
class Sent:
    """A trigger sent with an Idempotency-Key: what to replay, and the instance it made."""

    key: str
    job: str
    body: dict[str, Any]
    instance_id: str
    at: float = field(default_factory=time.monotonic)


class Answer:
    """A REST answer or a client call's outcome, read alike: ``status`` (the client's 2xx
    shows as 200/201 by the call) and ``body``."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body


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
    _http: httpx.AsyncClient | None = None
    _client: Client | None = None
    _thread: ThreadPoolExecutor | None = None
    #: How the current request goes: "rest" or "client" (the prefix of its ops counter).
    _via: str = "rest"

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="chaos-client")
        loop = asyncio.get_running_loop()
        self._client = await loop.run_in_executor(
            self._thread, functools.partial(Client, self.base, self.token, timeout_s=5)
        )
        try:
            async with httpx.AsyncClient(base_url=self.base, headers=headers, timeout=5) as http:
                self._http = http
                while not stop.is_set():
                    self._via = self.rng.choice(["rest", "client"])
                    try:
                        await self._one()
                    except (httpx.TransportError, JobplaneError):
                        # The api down or restarting: not acknowledged.
                        self.ops[f"{self._via}:transport_error"] += 1
                    await asyncio.sleep(self.rng.expovariate(self.rate_per_s))
        finally:
            await loop.run_in_executor(self._thread, self._client.close)
            self._thread.shutdown()

    def _count(self, what: str, answer: Answer, detail: str = "") -> None:
        self.ops[f"{self._via}:{what}:{answer.status}{detail}"] += 1

    async def _call(
        self,
        method: str,
        path: str,
        client_call: Callable[[Client], Any],
        *,
        created: bool = False,
        **kwargs: Any,
    ) -> Answer:
        """The request over REST (``method path`` with httpx ``kwargs``) or through the
        client (``client_call``), as ``_via`` says. A client error is an :class:`ApiError`
        (its status); a client success answers ``201`` when ``created`` else ``200``."""
        if self._via == "rest":
            assert self._http is not None
            response = await self._http.request(method, path, **kwargs)
            try:
                body = response.json()
            except ValueError:
                body = response.text
            return Answer(response.status_code, body)
        assert self._client is not None
        client = self._client
        try:
            body = await asyncio.get_running_loop().run_in_executor(
                self._thread, functools.partial(client_call, client)
            )
        except ApiError as error:
            return Answer(error.status, error.problem)
        return Answer(201 if created else 200, body)

    async def _one(self) -> None:
        roll = self.rng.random()
        if roll < 0.55 or not self.sent:
            await self._trigger()
        elif roll < 0.65:
            await self._batch()
        elif roll < 0.73:
            await self._replay()
        elif roll < 0.77:
            await self._conflict()
        elif roll < 0.87:
            await self._cancel()
        elif roll < 0.95:
            await self._retry()
        else:
            await self._pause_or_resume()

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

    async def _post_trigger(self, job: str, body: dict[str, Any], key: str) -> Answer:
        return await self._call(
            "POST",
            f"/api/v1/jobs/{job}/instances",
            lambda c: c.trigger(
                job,
                body["args"],
                delay_s=body.get("delay_s"),
                pinned_worker=body.get("pinned_worker"),
                idempotency_key=key,
            ),
            # A replay through the client cannot tell 200 from 201: it is read as a replay.
            created=True,
            json=body,
            headers={"Idempotency-Key": key},
        )

    async def _trigger(self) -> None:
        job = self.rng.choices(list(JOBS), weights=list(JOBS.values()))[0]
        body, key = self._body(job), f"k{self._n}"
        answer = await self._post_trigger(job, body, key)
        self._count("trigger", answer)
        if answer.status == 201:
            made = answer.body["id"]
            self.acks[made] = job
            self.sent.append(Sent(key, job, body, made))

    async def _batch(self) -> None:
        items = []
        for _ in range(self.rng.randint(2, 10)):
            job = self.rng.choice(["fast", "sync_work", "flaky", "limited_wait"])
            items.append({"job_key": job, **self._body(job), "idempotency_key": f"b{self._n}"})
        answer = await self._call(
            "POST",
            "/api/v1/instances/batch",
            lambda c: c.trigger_batch(items),
            created=True,
            json={"items": items},
        )
        self._count("batch", answer)
        if answer.status == 201:
            for item, made in zip(items, answer.body, strict=True):
                self.acks[made["id"]] = item["job_key"]

    async def _replay(self) -> None:
        first = self.rng.choice(self.sent)
        answer = await self._post_trigger(first.job, first.body, first.key)
        self._count("replay", answer)
        if answer.status in (200, 201) and answer.body["id"] != first.instance_id:
            self.violations.append(
                f"replay of {first.key} ({self._via}) gave {answer.body['id']}, "
                f"not {first.instance_id}"
            )

    async def _conflict(self) -> None:
        first = self.rng.choice(self.sent)
        body = {**first.body, "args": {"value": -1}}
        answer = await self._post_trigger(first.job, body, first.key)
        self._count("conflict", answer)
        if answer.status in (200, 201):
            self.violations.append(
                f"conflicting reuse of {first.key} accepted ({self._via}): {answer.body}"
            )

    async def _cancel(self) -> None:
        """Cancel one of the latest triggers (most are still queued or delayed), or a long job
        triggered a moment ago (most are running by now). Counted by the state answered:
        ``processing`` is a running one, asked to stop."""
        now = time.monotonic()
        running = [
            s
            for s in self.sent[-60:]
            if s.job in LONG and RUNNING_AFTER_S[0] <= now - s.at <= RUNNING_AFTER_S[1]
        ]
        pool = running if running and self.rng.random() < 0.5 else self.sent[-4:]
        target = self.rng.choice(pool).instance_id
        answer = await self._call(
            "POST", f"/api/v1/instances/{target}/cancel", lambda c: c.cancel(target)
        )
        state = f":{answer.body['state']}" if answer.status == 200 else ""
        self._count("cancel", answer, state)

    async def _retry(self) -> None:
        target = self.rng.choice(self.sent[-200:])
        path = f"/api/v1/instances/{target.instance_id}"
        state = await self._call("GET", path, lambda c: c.instance(target.instance_id))
        if state.status != 200 or state.body["state"] not in TERMINAL:
            self.ops[f"{self._via}:retry:not_terminal"] += 1
            return
        answer = await self._call(
            "POST", f"{path}/retry", lambda c: c.retry(target.instance_id), created=True
        )
        self._count("retry", answer)
        if answer.status == 201:
            self.acks[answer.body["id"]] = target.job

    async def _pause_or_resume(self) -> None:
        action = self.rng.choice(["pause", "resume", "edit"])
        if action == "edit":
            await self._edit()
            return
        answer = await self._call(
            "POST",
            f"/api/v1/jobs/{PAUSED_TICK}/{action}",
            lambda c: c.pause(PAUSED_TICK) if action == "pause" else c.resume(PAUSED_TICK),
        )
        self._count(action, answer)

    async def _edit(self) -> None:
        """Edit the paused-and-resumed recurring job's options at the version just read (a
        409 when another edit won meanwhile)."""
        job = await self._call("GET", f"/api/v1/jobs/{PAUSED_TICK}", lambda c: c.job(PAUSED_TICK))
        if job.status != 200:
            self.ops[f"{self._via}:edit:read_{job.status}"] += 1
            return
        version, limit = job.body["version"], self.rng.randint(5, 10)
        answer = await self._call(
            "PATCH",
            f"/api/v1/jobs/{PAUSED_TICK}",
            lambda c: c.edit_job(PAUSED_TICK, version, max_concurrency=limit),
            json={"version": version, "options": {"max_concurrency": limit}},
        )
        self._count("edit", answer)
