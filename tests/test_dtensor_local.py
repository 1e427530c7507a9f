"""``core._dtensor.local_group``: a kernel's group with its DTensors replaced by their local
shards, and the same object when it holds none, without walking every leaf.

A stand-in class plays DTensor here (a tensor subclass with ``_local_tensor``); the real
ones run on a gloo group in tests/test_fsdp2.py. Its ``_may_hold`` must never answer
"none" for a group that holds one, wherever it sits: in a list, a unit, a state field, a
dict, beside ``None`` holes or alone."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpfunc.core import _dtensor
from mpfunc.core._optimizer import Group


class _Shard(torch.Tensor):
    """Stands for DTensor: its local shard is another tensor."""

    _local_tensor: torch.Tensor


def _shard() -> _Shard:
    t = torch.zeros(3).as_subclass(_Shard)
    t._local_tensor = torch.ones(3)
    return t


class _Unit(NamedTuple):  # as a quantized moment: two tensors, one leaf
    codes: Any
    scale: Any


class _State(NamedTuple):
    step: Any
    m: Any


@pytest.fixture
def shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dtensor, "dtensor_type", lambda: _Shard)


PLACES = ("params", "grads", "step", "unit codes", "unit scale", "model", "lr", "dict")


def _group(n: int, place: str | None, at: int, holes: bool, units: bool) -> Group:
    def leaf(where: str, i: int) -> Any:
        if where == place and i == at:
            return _shard()
        if holes and i % 3 == 1 and where in ("grads", "model"):
            return None
        return torch.zeros(3)

    def moment(i: int) -> Any:
        if units:
            return _Unit(leaf("unit codes", i), leaf("unit scale", i))
        return leaf("unit codes", i)

    lr: Any = _shard() if place == "lr" else 1e-3
    model = [leaf("model", i) for i in range(n)]
    extra = {"a": _shard() if place == "dict" else torch.zeros(1), "b": None}
    return Group(
        [leaf("params", i) for i in range(n)],
        [leaf("grads", i) for i in range(n)],
        _State([leaf("step", i) for i in range(n)], [moment(i) for i in range(n)]),
        lr,
        None,
        model=model,
        scale=extra,  # (any node: the walk must look inside it too)
        salts=list(range(n)),
    )


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 6),
    st.one_of(st.none(), st.sampled_from(PLACES)),
    st.integers(0, 5),
    st.booleans(),
    st.booleans(),
)
@pytest.mark.usefixtures("shards")
def test_local_group_replaces_every_shard_and_keeps_a_group_without_one(
    n: int, place: str | None, at: int, holes: bool, units: bool
) -> None:
    if place in ("unit scale",) and not units:
        place = "unit codes"
    at = 0 if place in ("lr", "dict") else at % n
    group = _group(n, place, at, holes, units)
    out = _dtensor.local_group(group)
    if place is None:
        assert out is group  # nothing to replace: the same object, not a rebuilt copy
        assert not _dtensor._may_hold(group, _Shard)
        return
    assert _dtensor._may_hold(group, _Shard)
    assert out is not group

    def shards_in(x: Any) -> int:
        if isinstance(x, _Shard):
            return 1
        if isinstance(x, dict):
            return sum(shards_in(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(shards_in(v) for v in x)
        return 0

    assert shards_in(group) == 1 and shards_in(out) == 0


def test_may_hold_answers_yes_for_what_it_cannot_read() -> None:
    # An object of another kind (a node optree may know): the caller's exact walk decides.
    class Box:
        pass

    assert _dtensor._may_hold([torch.zeros(1), Box()], _Shard)
    assert not _dtensor._may_hold([torch.zeros(1), None, (torch.zeros(1),), {"a": []}], _Shard)
    # Empty containers at any depth end the walk (an empty list once looped forever).
    assert not _dtensor._may_hold([], _Shard)
    assert not _dtensor._may_hold(([], (), {}, [[]], [()]), _Shard)
    assert _dtensor._may_hold(([], [_shard()]), _Shard)
