"""``quick_init``: a frozen, slotted dataclass's ``__init__`` that sets slots through their
descriptors behaves as the generated one (arguments, defaults, errors, still frozen)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from datetime import UTC, datetime
from uuid import uuid4

import pytest

from jobplane.domain.frozen import quick_init
from jobplane.domain.models import Instance, InstanceSource
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

    for cls in (WithFactory, WithPostInit, KeywordOnly, WithoutSlots):
        with pytest.raises(TypeError):
            quick_init(cls)


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
