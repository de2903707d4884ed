"""The trigger form's argument inputs, generated from a job's argument JSON Schema.

A schema whose top-level properties are all strings, integers, numbers or booleans (with an
optional ``enum``) gets one input per property; any other schema (nested objects, arrays, none
at all) is edited as JSON. Values are converted from text only as far as their type says; the
job's schema itself, applied by the API's trigger, is the judge of what is valid, and its
refusal names the property (``args.name``), which the page shows at that input."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SIMPLE = ("string", "integer", "number", "boolean")
PREFIX = "arg."


@dataclass(frozen=True, slots=True)
class ArgField:
    name: str
    type: str
    required: bool
    title: str
    description: str
    enum: tuple[str, ...] = ()
    default: str = ""

    @property
    def input_name(self) -> str:
        return PREFIX + self.name


def arg_fields(schema: dict[str, Any] | None) -> list[ArgField] | None:
    """One field per property of a flat schema, in the schema's order; None when the
    arguments must be edited as JSON."""
    if not schema or schema.get("type") != "object" or not schema.get("properties"):
        return None
    required = set(schema.get("required") or ())
    fields = []
    for name, prop in schema["properties"].items():
        if not isinstance(prop, dict) or prop.get("type") not in SIMPLE:
            return None
        default = prop.get("default")
        fields.append(
            ArgField(
                name=name,
                type=prop["type"],
                required=name in required,
                title=str(prop.get("title") or name),
                description=str(prop.get("description") or ""),
                enum=tuple(str(v) for v in prop.get("enum") or ()),
                default="" if default is None else _text(default),
            )
        )
    return fields


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else ""
    return str(value)


def initial_values(fields: list[ArgField]) -> dict[str, str]:
    return {f.input_name: f.default for f in fields}


def args_from_form(fields: list[ArgField], form: dict[str, str]) -> dict[str, Any]:
    """The arguments the inputs hold. An empty optional input is left out (the job's default
    applies); a number that does not parse is passed on as text, for the schema to refuse at
    its field."""
    args: dict[str, Any] = {}
    for f in fields:
        raw = form.get(f.input_name, "")
        if f.type == "boolean":
            args[f.name] = raw == "on"
            continue
        if raw == "" and not f.required:
            continue
        args[f.name] = _number(raw, f.type) if f.type in ("integer", "number") else raw
    return args


def _number(raw: str, kind: str) -> Any:
    try:
        value = json.loads(raw.strip())
    except ValueError:
        return raw
    if isinstance(value, bool) or not isinstance(value, int | float):
        return raw
    return value if kind == "number" or isinstance(value, int) else raw
