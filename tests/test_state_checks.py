"""The encoded state formats' checks (8-bit ``QState``, 4-bit ``Q4State``) through
``apply_update_``: every way a stored moment can be wrong is refused naming its path,
before anything is written, and the bulk check of a whole field (``StateFormat.all_right``,
read every step on XLA) never passes a field that ``problem`` refuses leaf by leaf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.helpers import assert_unchanged, snapshot

import mpfunc
from mpfunc.state_formats import _state_format

U4: torch.dtype = torch.uint4  # type: ignore[attr-defined]
BF16 = torch.bfloat16


def _setup(sd: torch.dtype) -> tuple[Any, Any, Any, Any, Any]:
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(8, 8, generator=gen).to(BF16),
        "b": torch.randn(40, generator=gen).to(BF16),
    }
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-2, state_dtype=sd)
    state = opt.init(masters)
    grads = {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in params.items()}
    return params, masters, opt, state, grads


def _swap(q: Any, **fields: torch.Tensor) -> Any:
    return q._replace(**fields)


# (id, how the second moment of leaf "w" is spoiled, exception, message)
CASES: list[tuple[str, Callable[[Any, Any], Any], type[Exception], str]] = [
    ("a tensor", lambda q, o: q.codes, TypeError, r"expected a Q4?State"),
    ("the other format", lambda q, o: o, TypeError, r"expected a Q4?State"),
    ("codes dtype", lambda q, o: _swap(q, codes=q.codes.to(torch.int16)), ValueError,
     r"expected (packed )?codes torch\.uint8 of shape"),
    ("codes shape", lambda q, o: _swap(q, codes=torch.cat([q.codes.reshape(-1)] * 2)),
     ValueError, r"expected (packed )?codes torch\.uint8 of shape"),
    ("scale dtype", lambda q, o: _swap(q, scale=q.scale.float()), ValueError,
     r"expected scales torch\.bfloat16 of shape"),
    ("scale shape", lambda q, o: _swap(q, scale=q.scale[:1]), ValueError,
     r"expected scales torch\.bfloat16 of shape"),
    ("strided codes", lambda q, o: _swap(q, codes=_strided(q.codes)), ValueError,
     r"expected contiguous codes and scales"),
    ("strided scale", lambda q, o: _swap(q, scale=_strided(q.scale)), ValueError,
     r"expected contiguous codes and scales"),
    ("None", lambda q, o: None, TypeError, r"expected a tensor, got None"),
]  # fmt: skip


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous tensor of its shape and dtype."""
    return torch.stack([t, t], dim=-1)[..., 0]


@pytest.mark.parametrize("sd", [torch.uint8, U4], ids=["uint8", "uint4"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_stored_moment_is_refused_by_path_before_any_write(
    sd: torch.dtype, case: tuple[str, Callable[[Any, Any], Any], type[Exception], str]
) -> None:
    _, spoil, exc, message = case
    params, masters, opt, state, grads = _setup(sd)
    other = mpfunc.adamw(lr=1e-2, state_dtype=torch.uint8 if sd == U4 else U4).init(masters)
    bad_w = spoil(state.exp_avg_sq["w"], other.exp_avg_sq["w"])
    bad = state._replace(exp_avg_sq={"w": bad_w, "b": state.exp_avg_sq["b"]})
    snap = snapshot((masters, state, params))
    with pytest.raises(exc, match=r"at 'state\.exp_avg_sq\.w': " + message):
        mpfunc.apply_update_(masters, grads, bad, opt, params=params)
    assert_unchanged((masters, state, params), snap)
    # The bulk check says "not sure" wherever the leaf's own check refuses.
    fmt = _state_format.chosen(sd)
    assert fmt.all_right is not None
    faces = [masters["b"], masters["w"]]  # (sorted keys: b, w)
    moments = [bad.exp_avg_sq["b"], bad.exp_avg_sq["w"]]
    if bad_w is not None:
        assert not fmt.all_right("square", moments, faces)


@pytest.mark.parametrize("sd", [torch.uint8, U4], ids=["uint8", "uint4"])
def test_the_bulk_check_passes_right_fields(sd: torch.dtype) -> None:
    _, masters, _, state, _ = _setup(sd)
    fmt = _state_format.chosen(sd)
    assert fmt.all_right is not None
    faces = [masters["b"], masters["w"]]
    for kind, field in (("moment", state.exp_avg), ("square", state.exp_avg_sq)):
        moments = [field["b"], field["w"]]
        assert fmt.all_right(kind, moments, faces)
        assert all(fmt.problem(kind, x, f, sd) is None for x, f in zip(moments, faces))
        # Each field's map is its own: the first moment's codes are not the second's.
        swapped = "square" if kind == "moment" else "moment"
        assert not fmt.all_right(swapped, moments, faces)


@pytest.mark.parametrize("sd", [torch.uint8, U4], ids=["uint8", "uint4"])
@pytest.mark.parametrize("name", ["adam", "adamw", "lion", "sgd"])
def test_a_small_leaf_points_at_partition_with_its_own_optimizer(
    sd: torch.dtype, name: str
) -> None:
    """The hint's ``partition`` names the optimizer in use (it always said ``adamw``)."""
    masters = mpfunc.init_master({"w": torch.zeros(8, 8), "t": torch.zeros(3)})
    kw = {"lr": 0.1, "momentum": 0.9} if name == "sgd" else {}
    opt = getattr(mpfunc, name)(state_dtype=sd, **kw)
    key = "torch.uint8" if sd == torch.uint8 else "torch.uint4"
    with pytest.raises(ValueError, match=(
        rf"{name}\.init: at 'masters\.t': expected a leaf of at least 32 elements for "
        rf"state_dtype={key}, got 3 elements\. Keep small leaves in fp32 state: "
        rf"mpfunc\.partition\(\{{'big': mpfunc\.{name}\(\.\.\., state_dtype={key}\), "
        rf"'small': mpfunc\.{name}\(\.\.\.\)\}}, labels\)"
    )):  # fmt: skip
        opt.init(masters)
