"""Instances: the list (filters, keyset paging, live first page) and an instance's page
(timeline, attempts, args, result or error, live progress; cancel, retry, run now)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from jobplane.domain.attempts import attempts_of
from jobplane.domain.models import Instance
from jobplane.domain.states import InstanceState
from jobplane.errors import IllegalTransitionError, InstanceNotFoundError, JobplaneError
from jobplane_api.dashboard.listing import RANGES, listing_of
from jobplane_api.dashboard.render import render, set_flash
from jobplane_api.dashboard.session import OperatorDep, ViewerDep
from jobplane_api.deps import DispatcherDep, StoreDep
from jobplane_api.security import actor_of

router = APIRouter(include_in_schema=False)

PAGE_SIZE = 50


@router.get("/apps/{app}/instances", response_class=HTMLResponse)
@router.get("/instances", response_class=HTMLResponse)
async def list_instances(
    request: Request,
    session: ViewerDep,
    store: StoreDep,
    state: Annotated[list[str] | None, Query()] = None,
    job: str = "",
    worker: str = "",
    since: str = "",
    app: str = "",
    before: UUID | None = None,
    partial: bool = False,
) -> HTMLResponse:
    listing = await listing_of(
        store, state=state or (), job=job, worker=worker, since=since, app=app
    )
    page = await store.list_instances(listing.filter, limit=PAGE_SIZE, before=before)
    states, query = listing.states, listing.query
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    context: dict[str, Any] = {
        "nav": "instances",
        "here": here.replace("&partial=1", "").replace("?partial=1", ""),
        "instances": page.items,
        "next_cursor": page.next_cursor,
        "before": before,
        "query": query,
        "f": {"states": {s.value for s in states}, "job": job, "worker": worker, "since": since},
        "app": app,
        "ranges": RANGES,
        "jobs": listing.jobs,
        "unknown": listing.unknown,
        "now": await store.now(),
    }
    name = "_instances.html" if partial else "instances.html"
    return await render(request, session, name, context)


@router.get("/instances/{instance_id}", response_class=HTMLResponse)
async def instance_page(
    request: Request, session: ViewerDep, store: StoreDep, instance_id: UUID, partial: bool = False
) -> HTMLResponse:
    try:
        instance = await store.get_instance(instance_id)
    except InstanceNotFoundError:
        missing = {"title": "No such instance", "detail": f"There is no instance {instance_id}."}
        return await render(request, session, "error.html", missing, status=404)
    transitions = await store.transitions(instance_id)
    context: dict[str, Any] = {
        "nav": "instances",
        "i": instance,
        "transitions": transitions,
        "attempts": attempts_of(transitions, instance.error),
        "now": await store.now(),
    }
    name = "_instance.html" if partial else "instance.html"
    return await render(request, session, name, context)


@router.post("/instances/{instance_id}/cancel")
async def cancel(session: OperatorDep, dispatcher: DispatcherDep, instance_id: UUID) -> Response:
    async def act() -> str:
        done = await dispatcher.cancel(instance_id, actor_of(session.token))
        if done.state is InstanceState.CANCELLED:
            return "Cancelled."
        return "Cancel requested: the worker is told to stop."

    return await _act(instance_id, act)


@router.post("/instances/{instance_id}/run")
async def run_now(session: OperatorDep, dispatcher: DispatcherDep, instance_id: UUID) -> Response:
    async def act() -> str:
        await dispatcher.run_now(instance_id, actor_of(session.token))
        return "Enqueued: it runs now."

    return await _act(instance_id, act)


@router.post("/instances/{instance_id}/retry")
async def retry(session: OperatorDep, dispatcher: DispatcherDep, instance_id: UUID) -> Response:
    try:
        new = await dispatcher.retry(instance_id, actor_of(session.token))
    except JobplaneError as exc:  # not terminal, unknown, its job disabled or args now invalid
        return _redirect(instance_id, "error", f"Not retried: {exc}")
    response = RedirectResponse(f"/instances/{new.id}", status_code=303)
    set_flash(response, "ok", f"Retried as a new instance (retry of {instance_id}).")
    return response


async def _act(instance_id: UUID, act: Callable[[], Awaitable[str]]) -> Response:
    try:
        message = await act()
    except JobplaneError as exc:
        return _redirect(instance_id, "error", f"Refused: {exc}")
    return _redirect(instance_id, "ok", message)


def _redirect(instance_id: UUID, kind: str, message: str) -> Response:
    response = RedirectResponse(f"/instances/{instance_id}", status_code=303)
    set_flash(response, kind, message)
    return response


#: The most instances one bulk action takes (a page of the list is 50).
BULK_MAX = 500


@router.post("/instances/bulk")
async def bulk(
    request: Request, session: OperatorDep, dispatcher: DispatcherDep, store: StoreDep
) -> Response:
    """Cancel or retry the instances selected in the list (at most ``BULK_MAX``); those an
    action cannot apply to are skipped and counted, never an error."""
    form = await request.form()
    action = form.get("action")
    back = form.get("back")
    listing = isinstance(back, str) and back.startswith(("/instances", "/apps/"))
    target = back if listing and isinstance(back, str) else "/instances"
    ids: list[UUID] = []
    for raw in form.getlist("id")[:BULK_MAX]:
        try:
            ids.append(UUID(str(raw)))
        except ValueError:
            continue
    response = RedirectResponse(target, status_code=303)
    if not ids or action not in ("cancel", "retry"):
        set_flash(response, "error", "Select instances first, then an action.")
        return response
    actor = actor_of(session.token)
    if action == "cancel":
        message = await _cancel_each(dispatcher, ids, actor)
    else:
        found = [i for i in [await _get(store, n) for n in ids] if i is not None]
        retried, skipped = await dispatcher.retry_many(found, actor)
        message = f"Retried {len(retried)} as new instances; skipped {len(skipped)} (not ended)."
    set_flash(response, "ok", message)
    return response


async def _cancel_each(dispatcher: DispatcherDep, ids: list[UUID], actor: str) -> str:
    cancelled = requested = skipped = 0
    for instance_id in ids:
        try:
            done = await dispatcher.cancel(instance_id, actor)
        except (IllegalTransitionError, InstanceNotFoundError):
            skipped += 1
            continue
        if done.state is InstanceState.CANCELLED:
            cancelled += 1
        else:
            requested += 1
    return (
        f"Cancelled {cancelled}; told {requested} running to stop; "
        f"skipped {skipped} (already ended)."
    )


async def _get(store: StoreDep, instance_id: UUID) -> Instance | None:
    try:
        return await store.get_instance(instance_id)
    except InstanceNotFoundError:
        return None
