"""``mpfunc.Policy``: parsing, printing, and casts that touch only floating leaves.

The reference is ``Tensor.to(dtype)``: on the device itself every bit must match
(NaN payloads included, it is the same cast), and against the CPU every bit but NaN
payloads (torch's CPU casts canonicalize NaNs, XLA keeps them) and one backend quirk:
XLA's CPU backend flushes fp32/bf16 subnormals to (signed) zero when it widens them to
fp64, where torch's CPU keeps them (bf16 -> fp32 and fp16 -> fp64 keep them on both).
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_bits_equal, assert_unchanged, leaves, snapshot
from support.strategies import SHAPES, Pair, bits_tensor, tree_shapes

import mpfunc

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
CANONICAL = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
# Every name Policy.parse accepts, and the dtype it means.
NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
}
KEYS = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
}


def per_device(device: torch.device, cpu: int, xla: int) -> Any:
    """Hypothesis settings with fewer examples on XLA, where each new tree compiles."""
    return settings(max_examples=cpu if device.type == "cpu" else xla)


def sync(device: torch.device) -> None:
    """Runs the pending graph once before reading results (see test_clip_accumulate)."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


# --- parse and str ---------------------------------------------------------------------


def test_parse_full_spec() -> None:
    policy = mpfunc.Policy.parse("params=float32,compute=bfloat16,output=float32")
    assert policy == mpfunc.Policy(torch.float32, torch.bfloat16, torch.float32)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        torch.float32,
        torch.bfloat16,
        torch.float32,
    )


def test_parse_defaults_and_short_forms() -> None:
    assert mpfunc.Policy.parse("") == mpfunc.Policy()
    assert mpfunc.Policy() == mpfunc.Policy(torch.float32, torch.float32, torch.float32)
    # Omitted keys are float32; short keys, short names, any case, spaces around parts.
    assert mpfunc.Policy.parse("c=bf16") == mpfunc.Policy(compute_dtype=torch.bfloat16)
    assert mpfunc.Policy.parse(" P = Half , C=BF16 ,o=f64 ") == mpfunc.Policy(
        torch.float16, torch.bfloat16, torch.float64
    )


@pytest.mark.parametrize(("key", "field"), sorted(KEYS.items()))
@pytest.mark.parametrize(("name", "dtype"), sorted(NAMES.items()))
def test_parse_every_key_and_name(key: str, field: str, name: str, dtype: torch.dtype) -> None:
    policy = mpfunc.Policy.parse(f"{key}={name}")
    assert getattr(policy, field) == dtype
    for other in {"param_dtype", "compute_dtype", "output_dtype"} - {field}:
        assert getattr(policy, other) == torch.float32


@pytest.mark.parametrize("dtypes", list(itertools.product(FLOATS, repeat=3)), ids=str)
def test_str_round_trips_through_parse(dtypes: tuple[torch.dtype, ...]) -> None:
    policy = mpfunc.Policy(*dtypes)
    text = str(policy)
    names = ",".join(CANONICAL[d] for d in dtypes)
    assert text == "params={},compute={},output={}".format(*names.split(","))
    assert mpfunc.Policy.parse(text) == policy


def test_policy_is_frozen_and_hashable() -> None:
    policy = mpfunc.Policy.parse("c=bf16")
    with pytest.raises(AttributeError):
        policy.compute_dtype = torch.float16  # type: ignore[misc]
    assert hash(policy) == hash(mpfunc.Policy(compute_dtype=torch.bfloat16))


# --- bad specs -------------------------------------------------------------------------


def test_unknown_dtype_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"^Policy\.parse: unknown dtype 'float8' for params") as e:
        mpfunc.Policy.parse("params=float8")
    listed = str(e.value).split("expected one of ", 1)[1].split(", ")
    float8 = sorted(n for n in dir(torch) if n.startswith("float8_"))
    assert float8 and listed == [*NAMES, *float8]
    for name in listed:  # every name the message offers is taken
        got = mpfunc.Policy.parse(f"params={name}").param_dtype
        assert got is (getattr(torch, name) if name in float8 else NAMES[name])


def test_unknown_key_lists_the_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"^Policy\.parse: unknown key 'weights'") as e:
        mpfunc.Policy.parse("weights=float32")
    listed = str(e.value).split("expected one of ", 1)[1].split(", ")
    assert listed == list(KEYS)


@pytest.mark.parametrize(
    ("spec", "regex"),
    [
        ("params=fp32,p=bf16", r"^Policy\.parse: 'p' is given twice in 'params=fp32,p=bf16'$"),
        ("compute", r"^Policy\.parse: expected key=dtype, got 'compute'$"),
        ("compute:bf16", r"^Policy\.parse: expected key=dtype, got 'compute:bf16'$"),
        ("c=int32", r"^Policy\.parse: unknown dtype 'int32' for c; expected one of float32, "),
        ("c=", r"^Policy\.parse: unknown dtype '' for c; expected one of float32, "),
    ],
)
def test_parse_rejects_bad_specs(spec: str, regex: str) -> None:
    with pytest.raises(ValueError, match=regex):
        mpfunc.Policy.parse(spec)


def test_parse_rejects_a_non_string() -> None:
    with pytest.raises(TypeError, match=r"^Policy\.parse: expected a str, got dict$"):
        mpfunc.Policy.parse({"params": "float32"})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
@pytest.mark.parametrize(
    "value", [torch.int32, torch.bool, torch.complex64, "bfloat16", None], ids=str
)
def test_constructor_rejects_non_floating_dtypes(field: str, value: Any) -> None:
    regex = rf"^Policy: {field}: expected a floating torch\.dtype, got {re.escape(repr(value))}$"
    with pytest.raises(TypeError, match=regex):
        mpfunc.Policy(**{field: value})


# --- casts -----------------------------------------------------------------------------

# Non-tensor leaves a batch or a model output may carry next to its tensors.
OPAQUE = {"name": "batch", "count": 3, "ratio": 0.5, "flag": True, "none": None}


@st.composite
def mixed_trees(draw: st.DrawFn, device: torch.device) -> Any:
    """A nested tree of arbitrary-bit bf16/fp16/fp32 tensors with int/bool tensors and
    None (from strategies.tree_shapes) and plain Python leaves beside it, on ``device``."""

    def leaf() -> torch.Tensor:
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
        return bits_tensor(draw, draw(st.sampled_from(SHAPES)), dtype)

    tree = draw(tree_shapes(st.builds(leaf)))
    tree = optree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree, none_is_leaf=True
    )
    return {"tree": tree, **OPAQUE, "pair": Pair(torch.arange(4, device=device), "tag")}


CASTS = {
    "cast_to_param": "param_dtype",
    "cast_to_compute": "compute_dtype",
    "cast_to_output": "output_dtype",
}


def cpu_reference(device: torch.device, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` on the CPU, with XLA's flush of fp32/bf16 subnormals widened to fp64."""
    ref = t.cpu().to(dtype)
    if device.type == "xla" and dtype == torch.float64 and t.dtype != torch.float16:
        x = t.cpu()
        subnormal = (x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)
        ref = torch.where(subnormal, torch.copysign(torch.zeros_like(ref), ref), ref)
    return ref


def check_cast(device: torch.device, tree: Any, policy: mpfunc.Policy, method: str) -> None:
    dtype = getattr(policy, CASTS[method])
    snap = snapshot(tree)
    out = getattr(policy, method)(tree)
    sync(device)
    assert optree.tree_structure(out, none_is_leaf=True) == optree.tree_structure(
        tree, none_is_leaf=True
    )
    for t, r in zip(leaves(tree), leaves(out)):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            assert r.dtype == dtype and r.shape == t.shape and r.device == t.device
            # The device's own Tensor.to, every bit; the CPU's, every bit but NaN payloads.
            assert_bits_equal(r, t.to(dtype))
            assert_bits_equal(r, cpu_reference(device, t, dtype), nan_payload=device.type == "cpu")
        else:
            assert r is t  # int/bool tensors, None and Python leaves: the same objects
    assert_unchanged(tree, snap)


def test_casts_touch_only_floating_leaves(device: torch.device) -> None:
    @per_device(device, cpu=60, xla=15)
    @given(
        data=st.data(),
        dtypes=st.tuples(*[st.sampled_from(FLOATS)] * 3),
        method=st.sampled_from(sorted(CASTS)),
    )
    def prop(data: st.DataObject, dtypes: tuple[torch.dtype, ...], method: str) -> None:
        check_cast(device, data.draw(mixed_trees(device)), mpfunc.Policy(*dtypes), method)

    prop()


def test_cast_of_a_single_tensor_and_of_non_tensors(device: torch.device) -> None:
    policy = mpfunc.Policy.parse("params=float32,compute=bfloat16,output=float16")
    x = torch.linspace(-3, 3, 7, device=device)
    y = policy.cast_to_compute(x)
    sync(device)
    assert_bits_equal(y, x.to(torch.bfloat16))
    i = torch.arange(5, device=device)
    assert policy.cast_to_output(i) is i
    assert policy.cast_to_param(None) is None
    assert policy.cast_to_param("text") == "text"
    assert policy.cast_to_param({}) == {}
    assert policy.cast_to_param([]) == []


def test_the_docstring_example(device: torch.device) -> None:
    policy = mpfunc.Policy.parse("params=float32,compute=bfloat16,output=float32")
    model = torch.nn.Linear(4, 3).to(device)
    batch = {"x": torch.randn(2, 4).to(device), "idx": torch.arange(2, device=device)}
    x = policy.cast_to_compute(batch)
    assert x["x"].dtype == torch.bfloat16 and x["idx"] is batch["idx"]
    logits = policy.cast_to_output(model.to(policy.compute_dtype)(x["x"]))
    sync(device)
    assert logits.dtype == torch.float32 and logits.device == device


# torch's float8 dtypes present in this torch (2.4 has four of them).
FLOAT8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_policies_print_and_parse(dtype: torch.dtype) -> None:
    """A float8 param dtype was taken, but ``str()`` raised KeyError."""
    policy = mpfunc.Policy(param_dtype=dtype, compute_dtype=torch.bfloat16)
    name = str(dtype).removeprefix("torch.")
    assert str(policy) == f"params={name},compute=bfloat16,output=float32"
    assert mpfunc.Policy.parse(str(policy)) == policy


@pytest.mark.parametrize("method", sorted(CASTS))
def test_casts_keep_loss_scales_whole(device: torch.device, method: str) -> None:
    """A loss scale in a cast tree is state, not data: its fp32 scale rounded to bf16
    (or 2**16 to inf in fp16) changed the training silently."""
    policy = mpfunc.Policy(torch.float16, torch.float16, torch.float16)
    dynamic = mpfunc.DynamicLossScale(2.0**16 + 1, device=device)
    static = mpfunc.StaticLossScale(torch.tensor(3.0e5, device=device))
    tree = {"x": torch.ones(3, device=device), "ls": dynamic, "n": [static, None]}
    out = getattr(policy, method)(tree)
    assert out["x"].dtype == torch.float16
    assert out["ls"] is dynamic and out["n"][0] is static and out["n"][1] is None
    assert dynamic.loss_scale.dtype == torch.float32 and static.loss_scale.dtype == torch.float32
    assert getattr(policy, method)(dynamic) is dynamic
