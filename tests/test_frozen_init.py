"""``quick_init``: a frozen, slotted dataclass's ``__init__`` that sets slots through their
descriptors behaves as the generated one (arguments, defaults, errors, still frozen)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import typing
from datetime import UTC, datetime
from uuid import uuid4

import pytest

from jobplane.bus.envelope import Envelope
from jobplane.domain.frozen import quick_init
from jobplane.domain.models import Instance, InstanceSource, Outcome
from jobplane.domain.states import InstanceState


@dataclasses.dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()


@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class Quick:
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()


def _as_tuple(value: Plain | Quick) -> tuple[object, ...]:
    return (value.a, value.b, value.c)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1,), {}), ((1, "x"), {}), ((), {"a": 2, "c": (3,)}), ((4,), {"b": "y", "c": (5, 6)})],
)
def test_it_takes_the_arguments_and_defaults_the_generated_init_takes(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    assert _as_tuple(Quick(*args, **kwargs)) == _as_tuple(Plain(*args, **kwargs))  # type: ignore[arg-type]


def test_it_keeps_the_signature_and_refuses_what_the_generated_init_refuses() -> None:
    assert str(inspect.signature(Quick)) == str(inspect.signature(Plain))
    with pytest.raises(TypeError):
        Quick()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Quick(1, d=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Quick(1, "x", (), 4)  # type: ignore[call-arg]


def test_the_class_stays_frozen_comparable_hashable_and_picklable() -> None:
    made = Quick(1, "x", (2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.a = 2  # type: ignore[misc]
    assert made == Quick(1, "x", (2,)) and hash(made) == hash(Quick(1, "x", (2,)))
    assert dataclasses.replace(made, b="y") == Quick(1, "y", (2,))
    assert pickle.loads(pickle.dumps(made)) == made
    assert copy.copy(made) == made
    assert repr(made) == "Quick(a=1, b='x', c=(2,))"


def test_it_refuses_classes_it_cannot_build_as_the_dataclass_would() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class WithFactory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithPostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int

    @dataclasses.dataclass(frozen=True)
    class WithoutSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int] = 0

    @dataclasses.dataclass(frozen=True, slots=True, init=False)
    class OwnInit:
        a: int = 0

        def __init__(self, x: int) -> None:
            object.__setattr__(self, "a", x * 2)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Inheriting(Plain):
        d: int = 0

    refused = (
        WithFactory,
        WithPostInit,
        KeywordOnly,
        WithoutSlots,
        NotFrozen,
        WithInitVar,
        OwnInit,
        Inheriting,
    )
    for cls in refused:
        with pytest.raises(TypeError):
            quick_init(cls)
    assert OwnInit(2).a == 4  # left as it was


def test_a_field_may_have_any_name_the_generated_init_allows() -> None:
    @quick_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Named:
        self: int
        a: int = 1
        _set_a: int = 2

    made = Named(0, _set_a=5)
    assert (made.self, made.a, made._set_a) == (0, 1, 5)


@pytest.mark.parametrize("cls", [Instance, Outcome, Envelope])
def test_the_annotations_of_the_classes_made_in_bulk_resolve_as_before(cls: type) -> None:
    """Their ``__init__`` is made in their module, as the dataclass's was."""
    hints = typing.get_type_hints(vars(cls)["__init__"])
    assert hints == {**typing.get_type_hints(cls), "return": type(None)}
    assert str(inspect.signature(cls, eval_str=True)).startswith("(")


def test_an_instance_gets_every_field_it_is_given_and_the_defaults_of_the_rest() -> None:
    now = datetime.now(UTC)
    required = {
        "id": uuid4(),
        "job_key": "job",
        "state": InstanceState.ENQUEUED,
        "source": InstanceSource.TRIGGER,
        "queue": "default",
        "priority": 3,
        "args": {"n": 1},
        "created_at": now,
    }
    made = Instance(**required, attempt=2, reason="why")  # type: ignore[arg-type]
    for f in dataclasses.fields(Instance):
        expected = {**required, "attempt": 2, "reason": "why"}.get(f.name, f.default)
        assert getattr(made, f.name) == expected, f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.attempt = 3  # type: ignore[misc]
