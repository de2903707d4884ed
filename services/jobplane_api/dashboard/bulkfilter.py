"""Cancel or retry everything the instance list's filter selects, after a confirmation page
that counts it. The same form fields select the same instances as the list
(:mod:`jobplane_api.dashboard.listing`); the actions are the bulk API's (``POST
/api/v1/instances/cancel`` and ``/retry``: the dispatcher's ``cancel_many`` and
``retry_selected``), bounded the same way."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from jobplane.domain.models import Page
from jobplane.domain.states import InstanceState
from jobplane_api.dashboard.listing import Listing, listing_of
from jobplane_api.dashboard.render import render, set_flash
from jobplane_api.dashboard.session import OperatorDep
from jobplane_api.deps import DispatcherDep, StoreDep
from jobplane_api.routers.instances import CANCELLABLE
from jobplane_api.security import actor_of

router = APIRouter(include_in_schema=False)

#: The most instances one action on a filter takes; "run it again" covers the rest.
FILTER_MAX = 1000
#: What each action selects when the filter names no state (as the bulk API does).
DEFAULT_STATES = {"cancel": CANCELLABLE, "retry": (InstanceState.TERMINATED,)}


@router.post("/instances/bulk-filter", response_model=None)
async def bulk_filter(
    request: Request,
    session: OperatorDep,
    store: StoreDep,
    dispatcher: DispatcherDep,
) -> Response:
    form = await request.form()
    action = str(form.get("action") or "")
    listing = await listing_of(
        store,
        state=[str(s) for s in form.getlist("state")],
        job=str(form.get("job") or ""),
        worker=str(form.get("worker") or ""),
        since=str(form.get("since") or ""),
        app=str(form.get("app") or ""),
    )
    back = _list_url(listing)
    if listing.unknown:
        response = RedirectResponse(back, status_code=303)
        said = ", ".join(repr(v[:40]) for v in listing.unknown)
        set_flash(response, "error", f"Nothing done: {said} names no state or time range.")
        return response
    if action not in DEFAULT_STATES:
        response = RedirectResponse(back, status_code=303)
        set_flash(response, "error", "Choose cancel or retry.")
        return response
    if form.get("confirmed") != "1":
        return await _confirmation(request, session, store, listing, action, back)
    message = await _apply(dispatcher, listing, action, actor_of(session.token))
    response = RedirectResponse(back, status_code=303)
    set_flash(response, "ok", message)
    return response


async def _confirmation(
    request: Request,
    session: Any,
    store: StoreDep,
    listing: Listing,
    action: str,
    back: str,
) -> HTMLResponse:
    """The page that says how many instances the action would take, and asks."""
    selected = listing.with_default_states(DEFAULT_STATES[action])
    # Counted as the action selects: only what it changes.
    taken = selected.for_cancel() if action == "cancel" else selected.for_retry()
    page = Page([], None) if taken is None else await store.list_instances(taken, limit=FILTER_MAX)
    context: dict[str, Any] = {
        "nav": "instances",
        "app": next((v for k, v in listing.query if k == "app"), ""),
        "action": action,
        "count": len(page.items),
        "more": page.next_cursor is not None,
        "limit": FILTER_MAX,
        "states": [s.value for s in (selected if taken is None else taken).states],
        "fields": listing.query,
        "back": back,
    }
    return await render(request, session, "bulk_confirm.html", context)


async def _apply(dispatcher: DispatcherDep, listing: Listing, action: str, actor: str) -> str:
    selected = listing.with_default_states(DEFAULT_STATES[action])
    if action == "cancel":
        done = await dispatcher.cancel_many(selected, limit=FILTER_MAX, actor=actor)
        message = (
            f"Cancelled {len(done.cancelled)}; told {len(done.requested)} running to stop; "
            f"skipped {len(done.skipped)} (ended meanwhile)."
        )
        more = done.more
    else:
        retried = await dispatcher.retry_selected(selected, limit=FILTER_MAX, actor=actor)
        message = (
            f"Retried {len(retried.retried)} as new instances; skipped "
            f"{len(retried.skipped)} (job disabled, or arguments no longer valid)."
        )
        more = retried.more
    if more:
        message += f" More than {FILTER_MAX} matched: run it again for the rest."
    return message


def _list_url(listing: Listing) -> str:
    return "/instances" + (f"?{urlencode(listing.query)}" if listing.query else "")
