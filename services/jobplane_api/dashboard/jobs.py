"""Jobs: the list (filters by queue, kind, state, text) and a job's page (schedule, next fire
times, pause/resume, trigger form, its instances, version history).

Reads and actions go through the REST routes' own functions, so the dashboard applies exactly
the API's validation and bookkeeping."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any
from urllib.parse import quote
from zoneinfo import ZoneInfo

from fastapi import APIRouter, Form, HTTPException, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError
from starlette.responses import Response

from jobplane.domain.limits import MAX_JSON_DEPTH
from jobplane.domain.models import InstanceFilter
from jobplane.domain.options import JobKind
from jobplane.errors import (
    IdempotencyConflictError,
    InvalidOptionsError,
    JobDisabledError,
    JobNotFoundError,
)
from jobplane_api.dashboard.argsform import (
    PREFIX,
    ArgField,
    arg_fields,
    args_from_form,
    field_for_error,
    initial_values,
)
from jobplane_api.dashboard.durations import RUNS_SHOWN, DurationChart
from jobplane_api.dashboard.editing import (
    changes_from_form,
    edit_values,
    editable,
    versions_with_changes,
)
from jobplane_api.dashboard.render import render, set_flash
from jobplane_api.dashboard.session import AdminDep, OperatorDep, Session, ViewerDep
from jobplane_api.deps import BusDep, DispatcherDep, StoreDep
from jobplane_api.inputs import decimal
from jobplane_api.routers import jobs as api
from jobplane_api.schemas import VERSION_MAX, JobOut, JobPatch, RollbackIn, TriggerIn

router = APIRouter(include_in_schema=False)

INSTANCES_SHOWN = 15
VERSIONS_SHOWN = 10
#: Form fields of the trigger form, as the API's TriggerIn names them.
TRIGGER_FIELDS = ("args", "delay_s", "run_at", "priority", "idempotency_key")


@router.get("/apps/{app}", response_class=RedirectResponse)
async def app_home(session: ViewerDep, app: str) -> RedirectResponse:
    """An app's scope starts at its Overview."""
    return RedirectResponse(f"/apps/{quote(app, safe='')}/", status_code=303)


@router.get("/apps/{app}/jobs", response_class=HTMLResponse)
@router.get("/jobs", response_class=HTMLResponse)
async def list_jobs(
    request: Request,
    session: ViewerDep,
    store: StoreDep,
    q: str = "",
    queue: str = "",
    kind: str = "",
    paused: str = "",
    app: str = "",
) -> HTMLResponse:
    chosen_kind = JobKind(kind) if kind in set(JobKind) else None
    chosen_paused = {"yes": True, "no": False}.get(paused)
    found = await api.list_jobs(
        store, chosen_kind, queue or None, chosen_paused, q or None, app or None
    )
    every = await store.list_definitions()
    context: dict[str, Any] = {
        "nav": "jobs",
        "app": app,
        "jobs": found,
        "queues": sorted({d.options.queue for d in every if not app or d.app == app}),
        "apps": sorted({d.app for d in every if d.app}),
        "kinds": list(JobKind),
        "f": {"q": q, "queue": queue, "kind": kind, "paused": paused, "app": app},
        "now": await store.now(),
    }
    return await render(request, session, "jobs.html", context)


@dataclass(frozen=True, slots=True)
class Fire:
    at: datetime
    local: str
    dst_shift: str | None  # "+1 h" when the zone's offset changed since the previous fire


def fires_of(job: JobOut) -> list[Fire]:
    """The next fire times in the job's zone, marking those after a daylight-saving shift."""
    zone = ZoneInfo(job.options.timezone)
    out: list[Fire] = []
    previous: timedelta | None = None
    for at in job.next_fire_times:
        local = at.astimezone(zone)
        offset = local.utcoffset()
        shift = None
        if previous is not None and offset is not None and offset != previous:
            hours = (offset - previous).total_seconds() / 3600
            shift = f"{hours:+g} h"
        previous = offset
        out.append(Fire(at, local.strftime("%a %Y-%m-%d %H:%M:%S %Z"), shift))
    return out


def args_skeleton(schema: dict[str, Any] | None) -> str:
    """A starting point for the args field: each property with its default or an empty value
    of its type."""
    if not schema or schema.get("type") != "object":
        return ""
    empty = {"integer": 0, "number": 0, "string": "", "boolean": False, "array": [], "object": {}}
    out = {}
    for name, prop in (schema.get("properties") or {}).items():
        if isinstance(prop, dict):
            out[name] = prop.get("default", empty.get(str(prop.get("type"))))
    return json.dumps(out, indent=2) if out else "{}"


def _initial_form(job: JobOut) -> dict[str, str]:
    fields = arg_fields(job.args_schema)
    if fields is not None:
        return initial_values(fields)
    return {"args": args_skeleton(job.args_schema)}


def schema_fields(schema: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The top-level argument fields, for the form's help: name, type, required."""
    if not schema:
        return []
    required = set(schema.get("required") or ())
    return [
        {"name": n, "type": p.get("type", "any"), "required": n in required}
        for n, p in (schema.get("properties") or {}).items()
        if isinstance(p, dict)
    ]


async def job_page_response(
    request: Request,
    session: Session,
    store: StoreDep,
    key: str,
    *,
    status: int = 200,
    **overrides: Any,
) -> HTMLResponse:
    """A job's page; ``overrides`` replace context entries (a form re-shown with its input
    and errors: ``form``/``errors`` for the trigger form, ``edit``/``edit_errors`` for the
    options form)."""
    if request.query_params.get("partial") == "instances":
        # The live list polled by the page: its instances alone.
        page = await store.list_instances(InstanceFilter(job_key=key), limit=INSTANCES_SHOWN)
        live = {"instances": page.items, "now": await store.now()}
        return await render(request, session, "_job_instances.html", live)
    try:
        job = await api.get_job(store, key)
    except JobNotFoundError:
        missing = {"title": "No such job", "detail": f"There is no job with key {key!r}."}
        return await render(request, session, "error.html", missing, status=404)
    page = await store.list_instances(InstanceFilter(job_key=key), limit=INSTANCES_SHOWN)
    history = await store.definition_history(key)
    context: dict[str, Any] = {
        "nav": "jobs",
        "job": job,
        "durations": DurationChart.of(await store.recent_ends(key, RUNS_SHOWN)),
        "fires": fires_of(job),
        "instances": page.items,
        "more_instances": page.next_cursor is not None,
        "versions": versions_with_changes(history)[:VERSIONS_SHOWN],
        "fields": schema_fields(job.args_schema),
        "arg_fields": arg_fields(job.args_schema),
        "form": _initial_form(job),
        "errors": {},
        "edit": edit_values(job.options),
        "edit_version": job.version,
        "edit_errors": {},
        "now": await store.now(),
        **overrides,
    }
    return await render(request, session, "job.html", context, status=status)


@router.get("/jobs/{key}", response_class=HTMLResponse)
async def job_page(request: Request, session: ViewerDep, store: StoreDep, key: str) -> Response:
    return await job_page_response(request, session, store, key)


@router.post("/jobs/{key}/pause")
async def pause(session: OperatorDep, store: StoreDep, bus: BusDep, key: str) -> Response:
    await api.pause_job(store, bus, key, session.token)
    return _back(key, f"Paused {key}: it does not fire until resumed.")


@router.post("/jobs/{key}/resume")
async def resume(session: OperatorDep, store: StoreDep, bus: BusDep, key: str) -> Response:
    await api.resume_job(store, bus, key, session.token)
    return _back(key, f"Resumed {key}.")


def _back(key: str, message: str) -> Response:
    response = RedirectResponse(f"/jobs/{key}", status_code=303)
    set_flash(response, "ok", message)
    return response


@router.post("/jobs/{key}/trigger", response_class=HTMLResponse)
async def trigger(
    request: Request,
    session: OperatorDep,
    store: StoreDep,
    dispatcher: DispatcherDep,
    key: str,
    args: Annotated[str, Form(max_length=200_000)] = "",
    delay_s: Annotated[str, Form(max_length=40)] = "",
    run_at: Annotated[str, Form(max_length=60)] = "",
    priority: Annotated[str, Form(max_length=40)] = "",
    idempotency_key: Annotated[str, Form(max_length=200)] = "",
) -> Response:
    """Trigger from the form; what the API refuses is shown next to the field at fault."""
    form = {"args": args, "delay_s": delay_s, "run_at": run_at, "priority": priority}
    form["idempotency_key"] = idempotency_key
    sent = await request.form()
    form.update({k: v for k, v in sent.items() if k.startswith(PREFIX) and isinstance(v, str)})
    fields = arg_fields((await store.get_definition(key)).args_schema, form)
    errors: dict[str, str] = {}
    body = _trigger_body(form, fields, errors)
    if body is not None:
        try:
            made = await api.trigger_job(
                dispatcher, key, body, session.token, idempotency_key.strip() or None
            )
        except InvalidOptionsError as exc:
            errors.update(_at_field(exc, fields))
        except (JobDisabledError, IdempotencyConflictError) as exc:
            errors["form"] = str(exc)
        else:
            response = RedirectResponse(f"/instances/{made.id}", status_code=303)
            set_flash(response, "ok", f"Triggered {key}. This page follows the instance live.")
            return response
    return await job_page_response(
        request, session, store, key, form=form, errors=errors, arg_fields=fields, status=422
    )


def _at_field(exc: InvalidOptionsError, fields: list[ArgField] | None) -> dict[str, str]:
    """Where the page shows a refusal: at the generated input of the argument it names (or
    the nearest fieldset holding it), at the trigger field it names, or at the arguments."""
    at = field_for_error(fields or [], exc.field)
    if at is not None:
        return {at: exc.reason}
    if exc.field in TRIGGER_FIELDS:
        return {exc.field: exc.reason}
    return {"args": f"{exc.field}: {exc.reason}"}


def _trigger_body(
    form: dict[str, str], fields: list[ArgField] | None, errors: dict[str, str]
) -> TriggerIn | None:
    """The API's request body from the form's text fields, or None with ``errors`` filled."""
    raw: dict[str, Any] = {}
    text = form["args"].strip()
    if fields is not None:
        raw["args"] = args_from_form(fields, form)
    elif text:
        try:
            raw["args"] = json.loads(text)
        except json.JSONDecodeError as exc:
            errors["args"] = f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        except RecursionError:  # deeper than the parser goes; the API's limit is far below
            errors["args"] = f"nested deeper than {MAX_JSON_DEPTH} levels"
        except ValueError:  # an integer longer than Python converts
            errors["args"] = f"a number has more than {sys.get_int_max_str_digits()} digits"
    for name in ("delay_s", "run_at", "priority"):
        if form[name].strip():
            raw[name] = form[name].strip()
    try:
        body = TriggerIn.model_validate(raw)
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else "form"
            errors.setdefault(field, error["msg"])
        return None
    return None if errors else body


@router.post("/jobs/{key}/edit", response_class=HTMLResponse)
async def edit(
    request: Request, session: AdminDep, store: StoreDep, bus: BusDep, key: str
) -> Response:
    """Save the options form through the API's edit: its refusals are shown at the input
    they name; a version that moved on is explained, with the form kept."""
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    current = await store.get_definition(key)
    read_version = _read_version(form.get("version", ""))
    changes = changes_from_form(current.options, form)
    if not changes:
        return _back(key, "Nothing to save: no option was changed.")
    shown = {k: form.get(k, "") for k in editable(current.options.kind)}
    again = {"edit": shown, "edit_version": read_version}
    try:
        patch = JobPatch(version=read_version, options=changes)
        saved = await api.edit_job(store, bus, key, patch, session.token)
    except InvalidOptionsError as exc:
        field = exc.field.split(".")[0]
        errors = {field if field in shown else "form": exc.reason}
        return await job_page_response(
            request, session, store, key, status=422, edit_errors=errors, **again
        )
    except HTTPException as exc:
        if exc.status_code != status.HTTP_409_CONFLICT:
            raise
        return await _edit_conflict(request, session, store, key, read_version, form)
    return _back(key, f"Saved version {saved.version} of {key} ({', '.join(sorted(changes))}).")


def _read_version(text: str) -> int:
    """The version the form says it was read at; 0 (unknown, so the save is a conflict and
    the form comes back on the latest version) unless it is one a job can have."""
    version = decimal(text, len(str(VERSION_MAX)))
    return version if version is not None and version <= VERSION_MAX else 0


async def _edit_conflict(
    request: Request,
    session: Session,
    store: StoreDep,
    key: str,
    read_version: int,
    form: dict[str, str],
) -> HTMLResponse:
    """The job moved on since the form was read (or the form does not say when that was):
    the form is shown again on the latest version with only this user's changes applied (a
    save then keeps the other edit), and says what the other edit changed."""
    latest = await store.get_definition(key)
    read = next((v for v in await store.definition_history(key) if v.version == read_version), None)
    base = read.options if read is not None else latest.options
    mine = changes_from_form(base, form)
    theirs = [
        name
        for name, value in edit_values(latest.options).items()
        if edit_values(base).get(name) != value
    ]
    shown = {**edit_values(latest.options), **{k: form.get(k, "") for k in mine}}
    if read_version:
        moved = (
            f"{key} was changed by {latest.updated_by or 'someone'} while you edited it: you "
            f"read version {read_version}, it is now at version {latest.version}"
            + (f" ({', '.join(theirs)} changed)" if theirs else "")
        )
    else:  # no version, or none a job can have: whatever it was read at, it may be stale
        moved = (
            f"The form did not say which version of {key} it was read at; it is at version "
            f"{latest.version}"
        )
    detail = (
        moved
        + ". The form now shows that version with your changes "
        + f"({', '.join(sorted(mine)) or 'none'}) on top; check it and save again."
    )
    return await job_page_response(
        request,
        session,
        store,
        key,
        status=409,
        edit=shown,
        edit_errors={"form": detail},
        edit_version=latest.version,
    )


@router.post("/jobs/{key}/rollback")
async def rollback(
    session: AdminDep,
    store: StoreDep,
    bus: BusDep,
    key: str,
    to_version: Annotated[int, Form(ge=1, le=VERSION_MAX)],
    version: Annotated[int, Form(ge=1, le=VERSION_MAX)],
) -> Response:
    try:
        saved = await api.rollback_job(
            store, bus, key, RollbackIn(to_version=to_version, version=version), session.token
        )
    except HTTPException as exc:
        if exc.status_code != status.HTTP_409_CONFLICT:
            raise
        response = RedirectResponse(f"/jobs/{key}", status_code=303)
        set_flash(response, "error", f"Not rolled back: {exc.detail}. Reload and try again.")
        return response
    return _back(
        key, f"Rolled back: version {saved.version} has the options of version {to_version}."
    )
