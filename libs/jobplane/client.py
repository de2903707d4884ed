"""HTTP clients for the REST API: :class:`AsyncClient` and :class:`Client` (sync).

.. code-block:: python

    async with AsyncClient("http://jobplane:8000", token="jp_…") as jp:
        instance = await jp.trigger("send_receipt", {"order_id": 7})
        done = await jp.wait(instance["id"])

Errors come back as :class:`ApiError` carrying the problem+json body (status, title, detail,
field errors).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx

from jobplane.domain.limits import check_json
from jobplane.domain.states import TERMINAL_STATES
from jobplane.errors import ApiError as ApiError  # re-exported
from jobplane.errors import ConfigurationError, InvalidOptionsError, JobplaneError

JSONDict = dict[str, Any]
T = TypeVar("T")
TERMINAL = {s.value for s in TERMINAL_STATES}


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = {"title": response.reason_phrase, "detail": response.text[:200]}
        raise ApiError(response.status_code, body)
    if response.status_code == 204:
        return None
    if response.is_redirect:
        # (Not followed: a redirect of a POST would drop or repeat it. An http:// URL of an
        # api behind https, say: it was a JSONDecodeError's traceback.)
        where = response.headers.get("location", "elsewhere")
        raise JobplaneError(
            f"the API's URL answered {response.status_code}, a redirect to {where}: give "
            "the URL it redirects to"
        )
    try:
        return response.json()
    except ValueError:
        raise JobplaneError(
            f"the answer to {response.request.method} {response.request.url.path} is not "
            "JSON: is the URL the Jobplane API's?"
        ) from None


def _trigger_body(
    args: Any,
    delay_s: float | None = None,
    priority: int | None = None,
    run_at: datetime | None = None,
    pinned_worker: str | None = None,
) -> JSONDict:
    # Refused here as the API would refuse it (InvalidOptionsError naming ``args``).
    check_json(args, "args")
    body: JSONDict = {"args": args}
    if delay_s is not None:
        body["delay_s"] = _finite(delay_s, "delay_s")
    if run_at is not None:
        body["run_at"] = run_at.isoformat()
    if priority is not None:
        body["priority"] = priority
    if pinned_worker is not None:
        body["pinned_worker"] = pinned_worker
    return body


def _finite(value: Any, field: str) -> Any:
    """A number JSON can carry (NaN and infinities it cannot: httpx raised ValueError)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidOptionsError(field, "must be a finite number")
    return value


def _batch_item(item: Mapping[str, Any]) -> JSONDict:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in item.items()}


def _control(text: str) -> bool:
    """Whether ``text`` holds a control character (a header carries none)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _key_header(key: str | None) -> dict[str, str]:
    """The Idempotency-Key header: ASCII without control characters, as a header carries."""
    if not key:
        return {}
    if not key.isascii() or _control(key):
        raise InvalidOptionsError(
            "idempotency_key", "must be ASCII text without control characters (it is a header)"
        )
    return {"Idempotency-Key": key}


def _segment(value: object) -> str:
    if value == "":
        # (The empty segment named the collection's path: a redirect, then a traceback.)
        raise JobplaneError("an empty job key or instance id names nothing")
    return _quoted(value)


def _quoted(value: object) -> str:
    """``value`` (a job key, an instance id) as one segment of a request's path, percent-
    encoded: a value holding ``/``, ``?`` or ``#``, or one that is ``..``, names that resource
    (the API answers 404), never another endpoint. Put in the path as it came, ``retry("../jobs
    /send_receipt/instances#")`` posted to ``/api/v1/jobs/send_receipt/instances``: a trigger."""
    text = quote(str(value), safe="")
    # Dots are left as they are by quote(), but a segment of only dots is a step up the path.
    return text.replace(".", "%2E") if text in {".", ".."} else text


def _headers(token: str | None) -> dict[str, str]:
    if token and not token.isascii():
        # (HTTP headers are ASCII: it raised UnicodeEncodeError at the first request; the
        # documentation's placeholder ``jp_…`` pasted as it is, say.)
        raise ConfigurationError("the API token is not ASCII text: paste the whole token")
    if token and (token != token.strip() or _control(token)):
        # (A secret read from a file ends in a newline: the request failed as "cannot reach
        # the Jobplane API", with the header, the whole token, in the message.)
        raise ConfigurationError(
            "the API token has spaces or a line break in or around it: give the token alone"
        )
    return {"Authorization": f"Bearer {token}"} if token else {}


def _unreachable(exc: httpx.TransportError, timeout_s: float | None) -> JobplaneError:
    if isinstance(exc, httpx.TimeoutException):
        within = f" within {timeout_s:g} s" if timeout_s is not None else ""
        return JobplaneError(f"the Jobplane API did not answer{within}")
    if isinstance(exc, httpx.LocalProtocolError):
        # Its message quotes the header it refused: a secret, maybe.
        return JobplaneError("cannot send the request: a header value is not valid")
    return JobplaneError(f"cannot reach the Jobplane API: {exc or type(exc).__name__}")


class AsyncClient:
    """Async client. Owns its ``httpx.AsyncClient`` unless one is handed in."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._owns = http is None
        self._timeout_s = timeout_s
        if http is None:
            try:
                port = httpx.URL(url).port
            except httpx.InvalidURL as exc:
                raise ConfigurationError(f"the API URL {url!r} cannot be read: {exc}") from None
            if port is not None and not 0 < port < 65536:
                raise ConfigurationError(f"the API URL {url!r} has no valid port")
        self.http = http or httpx.AsyncClient(
            base_url=url, headers=_headers(token), timeout=timeout_s
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns:
            await self.http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return _check(await self.http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise _unreachable(exc, self._timeout_s) from exc

    async def jobs(self, **filters: Any) -> list[JSONDict]:
        return await self._call("GET", "/api/v1/jobs", params=_params(filters))  # type: ignore[no-any-return]

    async def job(self, key: str) -> JSONDict:
        return await self._call("GET", f"/api/v1/jobs/{_segment(key)}")  # type: ignore[no-any-return]

    async def edit_job(self, key: str, version: int, /, **options: Any) -> JSONDict:
        """Change options; ``version`` is the one read (409 if it moved on). Options the API
        refuses (``key``, ``kind``: fixed) come back as its 422."""
        for name, value in options.items():
            _finite(value, name)
        body = {"version": version, "options": options}
        return await self._call("PATCH", f"/api/v1/jobs/{_segment(key)}", json=body)  # type: ignore[no-any-return]

    async def versions(self, key: str) -> list[JSONDict]:
        """Every saved version of the job, newest first."""
        return await self._call("GET", f"/api/v1/jobs/{_segment(key)}/versions")  # type: ignore[no-any-return]

    async def rollback(self, key: str, to_version: int, *, version: int) -> JSONDict:
        """Save a new version with the options of ``to_version``; ``version`` is the current
        version as read (409 if it moved on)."""
        body = {"to_version": to_version, "version": version}
        return await self._call("POST", f"/api/v1/jobs/{_segment(key)}/rollback", json=body)  # type: ignore[no-any-return]

    async def pause(self, key: str) -> JSONDict:
        return await self._call("POST", f"/api/v1/jobs/{_segment(key)}/pause")  # type: ignore[no-any-return]

    async def resume(self, key: str) -> JSONDict:
        return await self._call("POST", f"/api/v1/jobs/{_segment(key)}/resume")  # type: ignore[no-any-return]

    async def trigger(
        self,
        key: str,
        args: Any = None,
        *,
        delay_s: float | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        pinned_worker: str | None = None,
        idempotency_key: str | None = None,
    ) -> JSONDict:
        """Create an instance now, after ``delay_s``, or at ``run_at`` (timezone-aware), on
        any worker or only on ``pinned_worker``. A replayed ``idempotency_key`` returns the
        first instance; reused with a different request it is an :class:`ApiError` 409.
        Arguments the API would refuse (nested deeper than 64 levels, over 1 MiB, NaN, NUL)
        raise :class:`~jobplane.errors.InvalidOptionsError` before anything is sent."""
        headers = _key_header(idempotency_key)
        return await self._call(  # type: ignore[no-any-return]
            "POST",
            f"/api/v1/jobs/{_segment(key)}/instances",
            json=_trigger_body(args, delay_s, priority, run_at, pinned_worker),
            headers=headers,
        )

    async def trigger_batch(self, items: Sequence[Mapping[str, Any]]) -> list[JSONDict]:
        """Create up to 1,000 instances, all or none. Each item has ``job_key`` and the fields
        of a trigger (``args``, ``delay_s`` or ``run_at``, ``priority``, ``pinned_worker``,
        ``idempotency_key``); datetimes are sent as ISO 8601."""
        for n, item in enumerate(items):
            check_json(item.get("args"), f"items.{n}.args")
            _finite(item.get("delay_s"), f"items.{n}.delay_s")
        body = {"items": [_batch_item(item) for item in items]}
        return await self._call("POST", "/api/v1/instances/batch", json=body)  # type: ignore[no-any-return]

    async def stats(self, job: str | None = None) -> JSONDict:
        """Instances by state and throughput per minute and per hour (all jobs, or one)."""
        return await self._call("GET", "/api/v1/stats", params=_params({"job": job}))  # type: ignore[no-any-return]

    async def scheduler(self) -> JSONDict:
        """The scheduler leader: who, which term, since when."""
        return await self._call("GET", "/api/v1/scheduler")  # type: ignore[no-any-return]

    async def instances(self, **filters: Any) -> JSONDict:
        return await self._call("GET", "/api/v1/instances", params=_params(filters))  # type: ignore[no-any-return]

    async def instance(self, instance_id: str) -> JSONDict:
        return await self._call("GET", f"/api/v1/instances/{_segment(instance_id)}")  # type: ignore[no-any-return]

    async def cancel(self, instance_id: str) -> JSONDict:
        return await self._call("POST", f"/api/v1/instances/{_segment(instance_id)}/cancel")  # type: ignore[no-any-return]

    async def retry(self, instance_id: str, *, idempotency_key: str | None = None) -> JSONDict:
        """A new instance retrying a terminal one. A replayed ``idempotency_key`` returns the
        first retry (even once retention deleted the retried instance)."""
        headers = _key_header(idempotency_key)
        return await self._call(  # type: ignore[no-any-return]
            "POST", f"/api/v1/instances/{_segment(instance_id)}/retry", headers=headers
        )

    async def run(self, instance_id: str) -> JSONDict:
        """Run a Scheduled instance (held by the debug mode, or delayed) now."""
        return await self._call("POST", f"/api/v1/instances/{_segment(instance_id)}/run")  # type: ignore[no-any-return]

    async def workers(self) -> list[JSONDict]:
        return await self._call("GET", "/api/v1/workers")  # type: ignore[no-any-return]

    async def wait(
        self, instance_id: str, *, poll_s: float = 0.2, timeout_s: float | None = None
    ) -> JSONDict:
        """Poll until the instance is terminal; return it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            found = await self.instance(instance_id)
            if found["state"] in TERMINAL:
                return found
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"instance {instance_id} is still {found['state']}")
            await asyncio.sleep(poll_s)


class Client:
    """Sync client: each call runs the :class:`AsyncClient` call on a private event loop, so
    both share one implementation. Not for use inside a running event loop (use AsyncClient)."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 30.0) -> None:
        self._runner = asyncio.Runner()
        self._async = AsyncClient(url, token, timeout_s=timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._async.close())
        self._runner.close()

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(call)

    def jobs(self, **filters: Any) -> list[JSONDict]:
        return self._run(self._async.jobs(**filters))

    def job(self, key: str) -> JSONDict:
        return self._run(self._async.job(key))

    def edit_job(self, key: str, version: int, /, **options: Any) -> JSONDict:
        return self._run(self._async.edit_job(key, version, **options))

    def versions(self, key: str) -> list[JSONDict]:
        return self._run(self._async.versions(key))

    def rollback(self, key: str, to_version: int, *, version: int) -> JSONDict:
        return self._run(self._async.rollback(key, to_version, version=version))

    def pause(self, key: str) -> JSONDict:
        return self._run(self._async.pause(key))

    def resume(self, key: str) -> JSONDict:
        return self._run(self._async.resume(key))

    def trigger(
        self,
        key: str,
        args: Any = None,
        *,
        delay_s: float | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        pinned_worker: str | None = None,
        idempotency_key: str | None = None,
    ) -> JSONDict:
        return self._run(
            self._async.trigger(
                key,
                args,
                delay_s=delay_s,
                run_at=run_at,
                priority=priority,
                pinned_worker=pinned_worker,
                idempotency_key=idempotency_key,
            )
        )

    def trigger_batch(self, items: Sequence[Mapping[str, Any]]) -> list[JSONDict]:
        return self._run(self._async.trigger_batch(items))

    def stats(self, job: str | None = None) -> JSONDict:
        return self._run(self._async.stats(job))

    def scheduler(self) -> JSONDict:
        return self._run(self._async.scheduler())

    def instances(self, **filters: Any) -> JSONDict:
        return self._run(self._async.instances(**filters))

    def instance(self, instance_id: str) -> JSONDict:
        return self._run(self._async.instance(instance_id))

    def cancel(self, instance_id: str) -> JSONDict:
        return self._run(self._async.cancel(instance_id))

    def retry(self, instance_id: str, *, idempotency_key: str | None = None) -> JSONDict:
        return self._run(self._async.retry(instance_id, idempotency_key=idempotency_key))

    def run(self, instance_id: str) -> JSONDict:
        return self._run(self._async.run(instance_id))

    def workers(self) -> list[JSONDict]:
        return self._run(self._async.workers())

    def wait(
        self, instance_id: str, *, poll_s: float = 0.2, timeout_s: float | None = None
    ) -> JSONDict:
        return self._run(self._async.wait(instance_id, poll_s=poll_s, timeout_s=timeout_s))


def _params(filters: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in filters.items() if v is not None}
