"""The dashboard's forms and cookies hold against what a client can write into them: digits
``int`` refuses, numbers and nesting past what the parsers take. Each was a 500."""

from __future__ import annotations

import base64
import html
import re

import httpx
import pytest

from jobplane.domain.models import InstanceFilter
from jobplane.store.sql import SqlStore
from jobplane_api.dashboard.argsform import arg_fields, args_from_form, field_for_error
from jobplane_api.dashboard.editing import edit_values
from jobplane_api.inputs import decimal
from jobplane_api.schemas import VERSION_MAX
from tests.apps.dashboard import app as jobs_app
from tests.fixtures.dashboard_client import csrf_of


async def test_a_flash_cookie_no_parser_reads_is_ignored(open_dash: httpx.AsyncClient) -> None:
    """The flash message's cookie comes back from the client: 2,500 nested brackets in it
    were a RecursionError, so every page a 500."""
    deep = base64.urlsafe_b64encode(b"[" * 2500).decode()
    for value in (deep, "!!", base64.urlsafe_b64encode(b'["ok", 1]').decode()):
        page = await open_dash.get("/jobs", headers={"Cookie": f"jp_flash={value}"})
        assert page.status_code == 200, page.text[:500]
        assert "flash-ok" not in page.text


def test_array_rows_are_only_short_ascii_indexes() -> None:
    """``str.isdigit`` takes "²" and "٣", which ``int`` refuses or reads as 3, and any
    length, while ``int`` refuses over 4,300 digits: a form key with such an index is no row
    (it was a ValueError, so a 500), and a refusal naming one goes to the nearest fieldset."""
    assert decimal("0", 6) == 0 and decimal("007", 6) == 7 and decimal("999999", 6) == 999999
    for bad in ("", "²", "٣", "\uff11", "1_0", " 1", "-1", "1.0", "9999999", "9" * 5000):
        assert decimal(bad, 6) is None, bad
    schema = jobs_app.jobs["ship_order"].args_schema()
    form = {"arg.lines.1.sku": "A-1"}
    for index in ("²", "٣", "9" * 5000, "1234567"):
        form[f"arg.lines.{index}.#"] = ""
        form[f"arg.lines.{index}.sku"] = "B-2"
    fields = arg_fields(schema, form)
    assert fields is not None
    lines = fields[2]
    assert [row.path for row in lines.fields] == ["lines.1"] and lines.next_row == 2
    assert args_from_form(fields, form)["lines"] == [{"sku": "A-1", "quantity": ""}]
    assert field_for_error(fields, "args.lines.0.sku") == "arg.lines.1.sku"
    for index in ("²", "9" * 5000):
        assert field_for_error(fields, f"args.lines.{index}.sku") == "arg.lines"


async def test_trigger_form_shows_unreadable_arguments_at_their_field(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """Arguments as JSON that parse to no value (a number of 5,000 digits, 5,000 nested
    brackets) are refused at the args field, like invalid JSON; generated inputs holding such
    text, or rows with an index that is no number, reach the schema's check as text (they
    were a ValueError or a RecursionError, so a 500)."""
    csrf = await csrf_of(open_dash, "/jobs/crunch")
    deep = "[" * 5000 + "]" * 5000
    for args, reason in (
        ("1" + "0" * 5000, "a number has more than 4300 digits"),
        (deep, "nested deeper than 64 levels"),
        ('{"a": ' + deep + "}", "nested deeper than 64 levels"),
        ("{oops", "not valid JSON: Expecting property name"),
    ):
        refused = await open_dash.post("/jobs/crunch/trigger", data={"args": args, "csrf": csrf})
        assert refused.status_code == 422, refused.text[:500]
        assert reason in refused.text[refused.text.index('id="args-error"') :][:200], args[:20]

    order = {"csrf": csrf, "arg.customer": "Ann", "arg.address.city": "Oslo"}
    for quantity in ("[" * 5000, "1" + "0" * 5000, "٣", "²"):
        line = {"arg.lines.0.#": "", "arg.lines.0.sku": "A-1", "arg.lines.0.quantity": quantity}
        refused = await open_dash.post("/jobs/ship_order/trigger", data={**order, **line})
        assert refused.status_code == 422, refused.text[:500]
        error = re.search(r'id="arg-lines-0-quantity-error" role="alert">([^<]*)<', refused.text)
        assert error and "integer" in error[1][-100:], (quantity[:20], refused.text[:500])
    for index in ("²", "9" * 5000):
        row = {f"arg.lines.{index}.#": "", f"arg.lines.{index}.sku": "A-1"}
        refused = await open_dash.post("/jobs/ship_order/trigger", data={**order, **row})
        assert refused.status_code == 422, refused.text[:500]
        assert "should be non-empty" in refused.text  # no row: the list is empty
    assert (await store.list_instances(InstanceFilter())).items == []


async def test_edit_form_takes_only_a_version_a_job_can_have(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """A version that is not up to 10 ASCII digits within the versions' range ("²", which
    ``str.isdigit`` takes and ``int`` refuses: a 500; 5,000 nines, over ``int``'s limit;
    past the store's 32 bits) says nothing about when the form was read: it is answered like
    a concurrent edit, the form shown again on the latest version, and nothing is saved."""
    csrf = await csrf_of(open_dash, "/jobs/greet")
    form = {**edit_values((await store.get_definition("greet")).options), "csrf": csrf}
    form["retries"] = "3"
    for version in ("²", "٣", "9" * 5000, str(VERSION_MAX + 1), str(2**63), "-1", "1.0", ""):
        answer = await open_dash.post("/jobs/greet/edit", data={**form, "version": version})
        assert answer.status_code == 409, (version[:12], answer.text[:500])
        assert "The form did not say which version of greet it was read at" in answer.text
        assert '<input type="hidden" name="version" value="1">' in answer.text
    assert (await store.get_definition("greet")).options.retries == 0
    saved = await open_dash.post("/jobs/greet/edit", data={**form, "version": "1"})
    assert saved.status_code == 303, saved.text[:500]
    assert (await store.get_definition("greet")).options.retries == 3


async def test_saving_options_keeps_a_descriptions_line_breaks(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """A description is a docstring, usually of several lines. It was shown in a one-line
    input, whose value a browser sends without its line breaks: saving any other option saved
    the description joined into one line. It is a textarea now, whose line breaks a browser
    sends as CRLF: the same text, left as it was."""
    from jobplane.domain.options import JobOptions

    text = "Build the report.\n\nReads the orders <b>and</b> mails the summary\nto finance."
    await store.register_definition(
        JobOptions.parse(key="nightly", kind="triggered", description=text), None, "test"
    )
    page = (await open_dash.get("/jobs/nightly")).text
    shown = re.search(r'<textarea[^>]* name="description"[^>]*>\n(.*?)</textarea>', page, re.S)
    assert shown is not None and html.unescape(shown.group(1)) == text

    csrf = await csrf_of(open_dash, "/jobs/nightly")
    form = {**edit_values((await store.get_definition("nightly")).options), "csrf": csrf}
    form |= {"version": "1", "priority": "7", "description": text.replace("\n", "\r\n")}
    saved = await open_dash.post("/jobs/nightly/edit", data=form)
    assert saved.status_code == 303, saved.text[:500]
    stored = await store.get_definition("nightly")
    assert (stored.options.priority, stored.options.description) == (7, text)
    [change] = [h for h in await store.definition_history("nightly") if h.version == 2]
    assert change.options.description == text

    form |= {"version": "2", "description": "One line now.\r\nAnd a second."}
    assert (await open_dash.post("/jobs/nightly/edit", data=form)).status_code == 303
    assert (await store.get_definition("nightly")).options.description == (
        "One line now.\nAnd a second."
    )


@pytest.mark.parametrize("char", ["é", "\N{GRINNING FACE}"])
async def test_a_long_refusal_is_still_said_after_the_redirect(
    open_dash: httpx.AsyncClient, store: SqlStore, char: str
) -> None:
    """Retrying an instance whose arguments the job's schema now refuses: the refusal quotes
    the arguments, and its flash cookie (6,805 bytes for 5,000 characters) was dropped by the
    browser, so the page said nothing. The message is cut to fit."""
    from jobplane.domain.models import NewInstance

    [made] = await store.create_instances(
        [NewInstance(job_key="greet", args={"name": [char * 5000]})]  # stored before a change
    )
    await store.request_cancel(made.id, "test")
    csrf = await csrf_of(open_dash, f"/instances/{made.id}")
    answer = await open_dash.post(f"/instances/{made.id}/retry", data={"csrf": csrf})
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith("jp_flash=") and len(cookie.split(";")[0]) < 4000
    page = (await open_dash.get(answer.headers["location"])).text
    shown = re.search(r'class="flash flash-error"[^>]*>([^<]*)<', page)
    assert shown is not None
    said = html.unescape(shown[1])
    assert said.startswith("Not retried: args.name: ") and said.endswith("…") and len(said) <= 400
    assert (await store.list_instances(InstanceFilter(job_key="greet"))).items == [
        await store.get_instance(made.id)
    ]


async def test_a_refusal_a_browser_meets_is_a_page(open_dash: httpx.AsyncClient) -> None:
    """A form sent for a job deleted meanwhile (or any refusal of a dashboard route) was
    answered with problem+json, which a browser shows as raw text. A request asking for HTML
    off the API's paths gets an HTML page with the same status; the API, and any client not
    asking for HTML, keep problem+json."""
    csrf = await csrf_of(open_dash, "/jobs/greet")
    page = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    for path, status in (("/jobs/nope/pause", 404), ("/jobs/greet/rollback", 422)):
        answer = await open_dash.post(path, data={"csrf": csrf}, headers=page)
        assert answer.status_code == status, answer.text[:300]
        assert answer.headers["content-type"].startswith("text/html")
        assert "<html" in answer.text and "frame-ancestors 'none'" in str(
            answer.headers["content-security-policy"]
        )
        plain = await open_dash.post(path, data={"csrf": csrf})
        assert plain.status_code == status
        assert plain.headers["content-type"] == "application/problem+json"
    missing = await open_dash.post("/jobs/nope/pause", data={"csrf": csrf}, headers=page)
    assert "no job with key" in html.unescape(missing.text)
    api = await open_dash.get("/api/v1/jobs/nope", headers=page)
    assert api.status_code == 404 and api.headers["content-type"] == "application/problem+json"
