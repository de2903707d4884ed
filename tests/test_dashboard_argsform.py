"""The trigger form's argument inputs, generated from a job's JSON Schema
(``dashboard/argsform.py``): which schemas get inputs, the values rebuilt from them, and a
refusal shown at its input."""

from __future__ import annotations

import re
from uuid import UUID

import httpx

from jobplane.store.sql import SqlStore
from jobplane_api.dashboard.argsform import (
    arg_fields,
    args_from_form,
    field_for_error,
    initial_values,
)
from tests.apps.dashboard import app as jobs_app


def test_argument_inputs_from_a_flat_schema_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "ratio": {"type": "number", "default": 0.5},
            "mode": {"type": "string", "enum": ["fast", "safe"]},
            "dry": {"type": "boolean", "default": True},
        },
        "required": ["n"],
    }
    fields = arg_fields(schema)
    assert fields is not None and [f.name for f in fields] == ["n", "ratio", "mode", "dry"]
    assert initial_values(fields) == {
        "arg.n": "",
        "arg.ratio": "0.5",
        "arg.mode": "",
        "arg.dry": "on",
    }
    form = {"arg.n": "7", "arg.ratio": "", "arg.mode": "safe"}
    assert args_from_form(fields, form) == {"n": 7, "mode": "safe", "dry": False}
    # Text that is not its type's number goes on as text, for the schema to refuse at "n".
    assert args_from_form(fields, {"arg.n": "7.5", "arg.ratio": "x"}) == {
        "n": "7.5",
        "ratio": "x",
        "dry": False,
    }
    untyped = {"type": "object", "properties": {"items": {"type": "array"}}}
    assert arg_fields(untyped) is None and arg_fields(None) is None
    either = {
        "type": "object",
        "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
    }
    assert arg_fields(either) is None  # a real union: edited as JSON


def test_property_names_an_input_cannot_carry_are_edited_as_json() -> None:
    """An input's name is the value's path joined by ".", and a row template's holds
    ``__<depth>__`` where a new row puts its index: ``{"meta.tag": "x"}`` was sent as
    ``{"tag": "x"}`` (the job ran with its default), ``{"user.name": …}`` could never be sent,
    and a row's ``x__1__y`` became ``x0y``. Such a schema is edited as JSON."""
    for name in ("meta.tag", "x__1__y", "__2__", "#", ""):
        flat = {"type": "object", "properties": {name: {"type": "string"}, "ok": {}}}
        assert arg_fields(flat) is None, name
        row = {"type": "object", "properties": {name: {"type": "string"}}}
        nested = {"type": "object", "properties": {"rows": {"type": "array", "items": row}}}
        assert arg_fields(nested) is None, name
    for name in ("user_name", "__dunder__", "a b", "größe", "x__y", "#tag"):
        fields = arg_fields({"type": "object", "properties": {name: {"type": "string"}}})
        assert fields is not None, name
        assert args_from_form(fields, {f"arg.{name}": "v"}) == {name: "v"}


def test_argument_inputs_for_nested_objects_and_arrays() -> None:
    """pydantic's schema of nested models ($defs, $ref): fieldsets for objects, rows for
    arrays (as many as the form sent), values rebuilt in shape, refusals mapped to inputs."""
    schema = jobs_app.jobs["ship_order"].args_schema()
    assert schema is not None and "$defs" in schema
    fields = arg_fields(schema)
    assert fields is not None
    # inputs, then objects, then lists; required first (jsonb keeps no key order)
    assert [f.path for f in fields] == ["customer", "address", "lines", "tags"]
    reordered = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    assert arg_fields(reordered) == fields
    _customer, address, lines, tags = fields
    assert address.type == "object" and [f.path for f in address.fields] == [
        "address.city",
        "address.postcode",
    ]
    assert lines.type == "array" and lines.fields == () and lines.item is not None
    assert [f.path for f in lines.item.fields] == [
        "lines.__1__.sku",
        "lines.__1__.quantity",
        "lines.__1__.serials",
    ]
    assert tags.item is not None and tags.item.type == "string"

    form = {
        "arg.customer": "Ann",
        "arg.address.city": "Oslo",
        "arg.address.postcode": "",
        "arg.lines.0.#": "",
        "arg.lines.0.sku": "A-1",
        "arg.lines.0.quantity": "2",
        "arg.lines.3.#": "",  # rows keep their index after others were removed
        "arg.lines.3.sku": "B-2",
        "arg.lines.3.quantity": "x",
        "arg.tags.0.#": "",
        "arg.tags.0": "gift",
    }
    fields = arg_fields(schema, form)
    assert fields is not None
    assert [row.path for row in fields[2].fields] == ["lines.0", "lines.3"]
    assert fields[2].next_row == 4
    assert args_from_form(fields, form) == {
        "customer": "Ann",
        "address": {"city": "Oslo"},
        "lines": [{"sku": "A-1", "quantity": 2}, {"sku": "B-2", "quantity": "x"}],
        "tags": ["gift"],
    }
    # The API names the position in the list sent: the second line is the form's row 3.
    assert field_for_error(fields, "args.lines.1.quantity") == "arg.lines.3.quantity"
    assert field_for_error(fields, "args.lines.0") == "arg.lines.0"
    assert field_for_error(fields, "args.lines") == "arg.lines"
    assert field_for_error(fields, "args.address") == "arg.address"
    assert field_for_error(fields, "args.lines.9.sku") == "arg.lines"  # nearest fieldset
    assert field_for_error(fields, "args.tags.0") == "arg.tags.0"
    assert field_for_error(fields, "args") is None


async def test_trigger_form_shows_a_nested_refusal_at_its_input(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    dash = open_dash
    page = (await dash.get("/jobs/ship_order")).text
    assert 'id="arg-address-city"' in page and "data-add-row" in page
    assert 'name="arg.lines.__1__.sku"' in page  # the row template
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf
    form = {
        "csrf": csrf[1],
        "arg.customer": "Ann",
        "arg.address.city": "Oslo",
        "arg.lines.0.#": "",
        "arg.lines.0.sku": "A-1",
        "arg.lines.0.quantity": "0",
    }
    refused = await dash.post("/jobs/ship_order/trigger", data=form)
    assert refused.status_code == 422
    html = refused.text
    error = html[html.index('id="arg-lines-0-quantity-error"') :][:300]
    assert "less than the minimum of 1" in error
    assert 'value="A-1"' in html  # the row is shown again with what was typed
    form["arg.lines.0.quantity"] = "3"
    made = await dash.post("/jobs/ship_order/trigger", data=form)
    assert made.status_code == 303
    instance = await store.get_instance(UUID(made.headers["location"].rsplit("/", 1)[1]))
    assert instance.args == {
        "customer": "Ann",
        "address": {"city": "Oslo"},
        "lines": [{"sku": "A-1", "quantity": 3}],
    }
