"""The trigger form's argument inputs, generated from a job's argument JSON Schema.

Strings, integers, numbers and booleans (with an optional ``enum``) get one input each;
objects become nested fieldsets and arrays a list of rows the user adds and removes. Local
``$ref`` s (``#/$defs/…``, as pydantic writes nested models) are followed and an optional
value (``anyOf`` with ``null``) is edited as its other branch. Any other schema (tuples,
unions, no properties at all, a property name an input's name cannot carry) is edited as JSON.

An input's name is ``arg.`` and the value's path, as the API names a refused value
(``args.items.0.sku`` is the input ``arg.items.0.sku``), so a refusal is shown at its input,
or at the nearest fieldset holding it. Values are converted from text only as far as their
type says; the job's schema, applied by the API's trigger, is the judge of what is valid.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jobplane_api.inputs import decimal

SIMPLE = ("string", "integer", "number", "boolean")
PREFIX = "arg."
#: A hidden input that keeps an object row when all its inputs are empty.
ROW_MARK = "#"
#: Nesting limit: a recursive schema is edited as JSON.
MAX_DEPTH = 6
#: A row index has at most this many digits: the form adds rows one at a time from 0, and a
#: form holds at most 1,000 fields. A key with a longer index (or any other text) is no row.
ROW_INDEX_DIGITS = 6
#: What an integer or number input converts from (JSON's number syntax, ASCII digits only):
#: anything else is sent on as text, for the schema to refuse at its field.
JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
#: What a property name must not hold to get inputs: an input's name is the value's path
#: joined by ".", a row template's paths hold ``__<depth>__`` where a new row puts its index,
#: and ``#`` is the row mark. ``{"meta.tag": …}`` was sent as ``{"tag": …}``.
UNNAMEABLE = re.compile(r"\.|__[0-9]+__|\A#\Z|\A\Z")


@dataclass(frozen=True, slots=True)
class ArgField:
    path: str  # "customer.address.city", "items.0.sku"; in a row template "items.__0__.sku"
    type: str  # a SIMPLE type, "object" or "array"
    required: bool
    title: str
    description: str = ""
    enum: tuple[str, ...] = ()
    default: str = ""
    fields: tuple[ArgField, ...] = ()  # an object's properties; an array's rows
    item: ArgField | None = None  # an array's row to copy when one is added
    placeholder: str = ""  # the index in ``item``'s paths that a new row replaces

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def input_name(self) -> str:
        return PREFIX + self.path

    @property
    def input_id(self) -> str:
        return "arg-" + re.sub(r"[^A-Za-z0-9_-]", "-", self.path)

    @property
    def next_row(self) -> int:
        return max((int(f.name) for f in self.fields), default=-1) + 1

    def walk(self) -> list[ArgField]:
        """This field and every field inside it (not the row templates)."""
        return [self, *(g for f in self.fields for g in f.walk())]


def arg_fields(
    schema: dict[str, Any] | None, form: dict[str, str] | None = None
) -> list[ArgField] | None:
    """The inputs of ``schema``'s top-level properties, in the schema's order, with the
    array rows ``form`` holds (none before the form was sent); None when the arguments must
    be edited as JSON."""
    if not schema or schema.get("type") != "object" or not schema.get("properties"):
        return None
    root = _Schema(schema, form or {})
    top = root.build(schema, "", True, "", 0)
    return list(top.fields) if top is not None else None


class _Schema:
    def __init__(self, root: dict[str, Any], form: dict[str, str]) -> None:
        self.root = root
        self.form = form

    def resolve(self, node: Any) -> dict[str, Any] | None:
        """``node`` with a local ``$ref`` followed and an optional (``anyOf`` with null)
        reduced to its other branch; None for anything else that is not a schema object."""
        for _ in range(MAX_DEPTH):
            if not isinstance(node, dict):
                return None
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                target: Any = self.root
                for part in ref[2:].split("/"):
                    target = target.get(part) if isinstance(target, dict) else None
                extra = {k: v for k, v in node.items() if k != "$ref"}
                node = {**target, **extra} if isinstance(target, dict) else None
                continue
            options = node.get("anyOf")
            if isinstance(options, list):
                kept = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
                if len(kept) != 1:
                    return None
                extra = {k: v for k, v in node.items() if k != "anyOf"}
                node = {**kept[0], **extra}
                continue
            return node
        return None

    def build(self, node: Any, path: str, required: bool, name: str, depth: int) -> ArgField | None:
        spec = self.resolve(node)
        if spec is None or depth > MAX_DEPTH:
            return None
        kind = spec.get("type")
        title = str(spec.get("title") or name)
        description = str(spec.get("description") or "")
        if kind in SIMPLE:
            default = spec.get("default")
            return ArgField(
                path,
                kind,
                required,
                title,
                description,
                enum=tuple(str(v) for v in spec.get("enum") or ()),
                default="" if default is None else _text(default),
            )
        if kind == "object":
            properties = spec.get("properties")
            if not isinstance(properties, dict) or not properties:
                return None
            if any(UNNAMEABLE.search(key) for key in properties):
                return None
            needed = set(spec.get("required") or ())
            fields = []
            for key, prop in properties.items():
                inner = self.build(prop, _join(path, key), key in needed, key, depth + 1)
                if inner is None:
                    return None
                fields.append(inner)
            fields.sort(key=_shown_order)
            return ArgField(path, "object", required, title, description, fields=tuple(fields))
        if kind == "array" and path:
            placeholder = f"__{depth}__"
            item = self.build(spec.get("items"), _join(path, placeholder), True, "item", depth + 1)
            if item is None:
                return None
            rows = []
            for index in self._rows(path):
                row = self.build(spec.get("items"), _join(path, index), True, "item", depth + 1)
                assert row is not None  # the same schema as ``item``
                rows.append(row)
            return ArgField(
                path,
                "array",
                required,
                title,
                description,
                fields=tuple(rows),
                item=item,
                placeholder=placeholder,
            )
        return None

    def _rows(self, path: str) -> list[str]:
        """The row indexes of the array at ``path`` that the form holds, in order."""
        start = PREFIX + path + "."
        heads = (key[len(start) :].split(".", 1)[0] for key in self.form if key.startswith(start))
        found = {index for head in heads if (index := decimal(head, ROW_INDEX_DIGITS)) is not None}
        return [str(n) for n in sorted(found)]


def _shown_order(field: ArgField) -> tuple[int, int]:
    """Inputs first, then nested objects, then lists; required before optional within each.
    (A schema's property order does not survive Postgres's jsonb, which sorts keys, so the
    form orders them by what they are; the sort is stable, keeping the schema's order when
    it is known.)"""
    kind = {"object": 1, "array": 2}.get(field.type, 0)
    return kind, 0 if field.required else 1


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else ""
    return str(value)


def initial_values(fields: list[ArgField]) -> dict[str, str]:
    return {f.input_name: f.default for top in fields for f in top.walk() if f.type in SIMPLE}


def args_from_form(fields: list[ArgField], form: dict[str, str]) -> dict[str, Any]:
    """The arguments the inputs hold. An empty optional input is left out (the job's default
    applies), and so is an optional object none of whose inputs was filled; a number that
    does not parse is passed on as text, for the schema to refuse at its field."""
    args: dict[str, Any] = {}
    for f in fields:
        present, value = _value(f, form)
        if present:
            args[f.name] = value
    return args


def _value(f: ArgField, form: dict[str, str]) -> tuple[bool, Any]:
    if f.type == "object":
        inner = args_from_form(list(f.fields), form)
        return bool(inner) or f.required, inner
    if f.type == "array":
        rows = [value for row in f.fields for present, value in [_value(row, form)] if present]
        return bool(rows) or f.required, rows
    raw = form.get(f.input_name, "")
    if f.type == "boolean":
        return True, raw == "on"
    if raw == "" and not f.required:
        return False, None
    return True, _number(raw, f.type) if f.type in ("integer", "number") else raw


def field_for_error(fields: list[ArgField], location: str) -> str | None:
    """The input name at which to show a refusal of the API at ``location``
    (``args.lines.1.quantity``): that input, or the nearest fieldset that holds it. An index
    in the location is a position in the list sent, which is the row's position among the
    form's rows (a row keeps its input index when an earlier one is removed)."""
    if not location.startswith("args."):
        return None
    found: ArgField | None = None
    children: tuple[ArgField, ...] = tuple(fields)
    for part in location[len("args.") :].split("."):
        if found is not None and found.type == "array":
            index = decimal(part, ROW_INDEX_DIGITS)
            step = found.fields[index] if index is not None and index < len(found.fields) else None
        else:
            step = next((f for f in children if f.name == part), None)
        if step is None:
            break
        found, children = step, step.fields
    return found.input_name if found is not None else None


def _number(raw: str, kind: str) -> Any:
    text = raw.strip()
    # Only a number goes to the parser: "[[[…" could exhaust its stack (a RecursionError).
    if JSON_NUMBER.fullmatch(text) is None:
        return raw
    try:
        value = json.loads(text)
    except ValueError:  # an integer longer than int() converts (4,300 digits)
        return raw
    return value if kind == "number" or isinstance(value, int) else raw
