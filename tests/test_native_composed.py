"""The native composed step (every master strategy with every state format, one pass on
the CPU) against its specification, the torch path: the strategy's load, torch's fused
kernel on fp32 temporaries, the state format's and the strategy's stores.

Drawn: strategies, state dtypes, amsgrad, Adam and AdamW, grad dtypes, fp16 params where
the strategy takes them, layouts (the native pass takes dense leaves, and contiguous ones
where draws or 8- and 4-bit blocks follow the element index; the rest stay on the torch
path),
NaN/inf/subnormal/huge values, skipped steps, loss scales, tensor lrs and several steps.
Bits must agree (NaN payloads aside), and the native kernel must have run where it can.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfunc
from mpfunc.core._optimizer import Group
from mpfunc.optim import _adam
from tests.support.helpers import assert_trees_bits_equal, assert_unchanged, laid_out, snapshot
from tests.support.native import native_module

STRATEGIES = ["fp32", "remainder", "kahan", "stochastic", "none"]
U4 = torch.uint4  # type: ignore[attr-defined]  (absent from torch's stubs)
STATE_DTYPES = [None, torch.bfloat16, torch.uint8, U4]
BLOCKED = (torch.uint8, U4)  # moments in 32-element blocks whose codes follow the index
# (name, shape, make from a contiguous tensor): n % 16 and n % 8 tails included (odd
# lengths: a 4-bit state's last byte is half used); every shape holds at least one block.
LAYOUTS: list[tuple[str, tuple[int, ...]]] = [
    ("contiguous", (37,)),
    ("contiguous", (1000,)),
    ("contiguous", (5, 64)),  # "remainder": rows of whole tie bytes
    ("transposed", (9, 7)),
    ("channels_last", (2, 3, 4, 3)),
    ("sliced", (6, 8)),
]
SPECIALS = [float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -0.0, 0.0]


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


@pytest.fixture
def composed(monkeypatch: pytest.MonkeyPatch, native: Any) -> Iterator[list[int]]:
    seen: list[int] = []
    real = _adam._composed

    def spy(group: Group, h: Any) -> None:
        seen.append(len(group.params))
        real(group, h)

    monkeypatch.setattr(_adam, "_composed", spy)
    yield seen


def _values(gen: torch.Generator, n: int, scale: float, specials: bool) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * scale
    if specials:
        idx = torch.randint(0, n, (len(SPECIALS),), generator=gen)
        x[idx] = torch.tensor(SPECIALS)
    return x


def _case(data: st.DataObject) -> dict[str, Any]:
    strategy = data.draw(st.sampled_from(STRATEGIES), "strategy")
    pdt = torch.bfloat16
    if strategy in ("kahan", "none"):
        pdt = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), "param dtype")
    return dict(
        strategy=strategy,
        pdt=pdt,
        state_dtype=data.draw(st.sampled_from(STATE_DTYPES), "state_dtype"),
        amsgrad=data.draw(st.booleans(), "amsgrad"),
        decoupled=data.draw(st.booleans(), "decoupled"),
        maximize=data.draw(st.booleans(), "maximize"),
        gdt=data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), "grad"),
        layouts=data.draw(st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3), "layouts"),
        specials=data.draw(st.booleans(), "specials"),
        skip=data.draw(st.lists(st.booleans(), min_size=3, max_size=3), "skips"),
        scale=data.draw(st.sampled_from([None, 1.0, 1024.0]), "scale"),
        tensor_lr=data.draw(st.booleans(), "tensor lr"),
        seed=data.draw(st.integers(0, 2**16), "seed"),
    )


def _run(c: dict[str, Any], impl: str) -> Any:
    gen = torch.Generator().manual_seed(c["seed"])
    params = {
        f"p{i}": laid_out(kind, shape, _values(gen, _numel(shape), 0.5, False).to(c["pdt"]))
        for i, (kind, shape) in enumerate(c["layouts"])
    }
    masters = mpfunc.init_master(params, strategy=c["strategy"], seed=3)
    lr: Any = torch.tensor(1e-2) if c["tensor_lr"] else 1e-2
    make = mpfunc.adamw if c["decoupled"] else mpfunc.adam
    opt = make(lr=lr, weight_decay=0.1, amsgrad=c["amsgrad"], maximize=c["maximize"],
               state_dtype=c["state_dtype"], impl=impl)  # fmt: skip
    state = opt.init(masters)
    kw: dict[str, Any] = {"params": params} if c["strategy"] == "fp32" else {}
    for k, skip in enumerate(c["skip"]):
        grads = {
            n: _values(gen, p.numel(), 1.0, c["specials"] and k == 1)
            .to(c["gdt"])
            .reshape(p.shape)
            .to(memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format)
            for n, p in params.items()
        }
        if c["scale"] is not None:
            kw["scale"] = torch.tensor(c["scale"])
        masters, state = mpfunc.apply_update_(
            masters, grads, state, opt, skip=torch.tensor(skip), **kw
        )
    return params, masters, state


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_native_composed_equals_torch_path(composed: list[int], data: st.DataObject) -> None:
    c = _case(data)
    composed.clear()  # (one fixture serves every example)
    want = _run(c, "fused")
    assert not composed
    got = _run(c, "auto")
    assert_trees_bits_equal(got, want, nan_payload=False)
    if c["strategy"] == "fp32" and c["state_dtype"] is None:
        return  # the fp32 kernel's own case
    # Grads are contiguous (channels_last for 4-d leaves): the native pass takes every leaf
    # whose param shares that layout.
    if any(kind in ("contiguous", "channels_last") and (kind == "contiguous" or not (
        c["strategy"] == "stochastic" or c["state_dtype"] in BLOCKED))
        for kind, _ in c["layouts"]):  # fmt: skip
        assert composed, "the native composed step never ran"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
def test_every_pair_takes_the_native_pass(
    composed: list[int], strategy: str, state_dtype: Any
) -> None:
    params = {"w": torch.randn(64, 48).bfloat16(), "b": torch.randn(40).bfloat16()}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = mpfunc.adamw(lr=1e-3, state_dtype=state_dtype)
    state = opt.init(masters)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
    mpfunc.apply_update_(masters, grads, state, opt, **kw)
    plain = strategy == "fp32" and state_dtype is None
    assert composed == ([] if plain else [2])


def test_native_refuses_a_wrong_call_before_writing(native: Any) -> None:
    p = torch.randn(64).bfloat16()
    r = torch.zeros(64, dtype=torch.int16)
    t = torch.zeros(8, dtype=torch.uint8)
    g = torch.randn(64).bfloat16()
    m, v = torch.zeros(64), torch.zeros(64)
    step = torch.zeros(())
    before = snapshot([p, r, t, m, v, step])
    args = dict(lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                decoupled=True, amsgrad=False, maximize=False, grad_scale=None,
                found_inf=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"remainder"):
        # a remainder of another shape
        native.step_composed_(1, 0, [p], [r[:32], t], [g], [[m], [v]], [], [step], [], [],
                              *args.values())  # fmt: skip
    with pytest.raises(TypeError, match=r"at \[0\]"):
        # an fp32 param for the remainder strategy
        native.step_composed_(1, 0, [p.float()], [r, t], [g], [[m], [v]], [], [step], [], [],
                              *args.values())  # fmt: skip
    with pytest.raises(ValueError, match=r"expected tie bits of shape"):
        # tie bits of another size
        native.step_composed_(1, 0, [p], [r, t[:4]], [g], [[m], [v]], [], [step], [], [],
                              *args.values())  # fmt: skip
    assert_unchanged([p, r, t, m, v, step], before)


def test_decode_tables_are_one_division() -> None:
    # The fused 8-bit piece computes table entry k as k / (254 - |k|) (signed) or
    # k / (508 - k) (unsigned) with one fp32 division: the tables' bits, every entry.
    from mpfunc.state_formats import _quantize

    k = torch.arange(-127, 128, dtype=torch.float32)
    assert torch.equal(_quantize._TABLE_CPU[True][1:], k / (254 - k.abs()))
    k = torch.arange(0, 255, dtype=torch.float32)
    assert torch.equal(_quantize._TABLE_CPU[False][:255], k / (508 - k))


def _wide_rule(rule: str, state_dtype: Any, impl: str) -> Any:
    kw: dict[str, Any] = dict(state_dtype=state_dtype, impl=impl)
    return {
        "adamw": lambda: mpfunc.adamw(lr=1e-2, weight_decay=0.1, **kw),
        "adamw-amsgrad": lambda: mpfunc.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
        "sgd": lambda: mpfunc.sgd(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, **kw),
        "lion": lambda: mpfunc.lion(lr=1e-3, weight_decay=0.1, **kw),
    }[rule]()


def _wide(gen: torch.Generator, n: int) -> torch.Tensor:
    # Magnitudes from 1e-38 to 1e30, all-zero blocks, specials, and blocks whose largest
    # value rounds up to the next bf16 scale.
    x = torch.randn(n, generator=gen) * torch.pow(
        10.0, torch.empty(n).uniform_(-38, 30, generator=gen)
    )
    blocks = x.view(-1, 32) if n % 32 == 0 else x[: n - n % 32].view(-1, 32)
    blocks[::7] = 0.0
    blocks[3::11, 5] = 1.00390625 * blocks[3::11].abs().amax(dim=1)
    idx = torch.randint(0, n, (len(SPECIALS),), generator=gen)
    x[idx] = torch.tensor(SPECIALS)
    return x


@pytest.mark.parametrize("state_dtype", BLOCKED, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("rule", ["adamw", "adamw-amsgrad", "sgd", "lion"])
def test_fused_8bit_blocks_equal_the_tiles(
    monkeypatch: pytest.MonkeyPatch, native: Any, strategy: str, rule: str, state_dtype: Any
) -> None:
    # The 8- and 4-bit moments' fused pieces (registers) against the tiles (tables,
    # phases), both checked against the torch path, on values far wider than an
    # optimizer's: each bit of codes, scales, masters and params must agree.
    def run(tiles: bool) -> Any:
        if tiles:
            monkeypatch.setenv("MPFUNC_NATIVE_TILES", "1")
        else:
            monkeypatch.delenv("MPFUNC_NATIVE_TILES", raising=False)
        gen = torch.Generator().manual_seed(7)
        params = {"w": _wide(gen, 4096).bfloat16().view(64, 64), "b": _wide(gen, 1000).bfloat16()}
        masters = mpfunc.init_master(params, strategy=strategy, seed=5)
        opt = _wide_rule(rule, state_dtype, "auto")
        state = opt.init(masters)
        kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
        for _ in range(3):
            grads = {k: _wide(gen, v.numel()).view(v.shape).bfloat16() for k, v in params.items()}
            masters, state = mpfunc.apply_update_(masters, grads, state, opt, **kw)
        return params, masters, state

    assert_trees_bits_equal(run(False), run(True), nan_payload=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_momentum_above_bf16s_largest_keeps_its_8bit_block(strategy: str) -> None:
    # SGD's first momentum is the grad itself: 3.39e38 is finite in fp32 but above bf16's
    # largest value, and its block's scale is clamped (not inf). Native and torch paths agree.
    def run(impl: str) -> Any:
        params = {"w": torch.linspace(-1, 1, 96).bfloat16()}
        masters = mpfunc.init_master(params, strategy=strategy, seed=1)
        opt = mpfunc.sgd(lr=0.0, momentum=0.9, state_dtype=torch.uint8, impl=impl)
        state = opt.init(masters)
        g = torch.linspace(-1, 1, 96)
        g[5] = 3.39e38
        kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
        masters, state = mpfunc.apply_update_(masters, {"w": g}, state, opt, **kw)
        return params, masters, state

    want, got = run("foreach"), run("auto")
    assert_trees_bits_equal(got, want, nan_payload=False)
    buf = got[2].momentum_buffer["w"]
    assert bool(buf.scale.float().isfinite().all())


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_native_4bit_equals_torch_path(
    monkeypatch: pytest.MonkeyPatch, native: Any, data: st.DataObject
) -> None:
    # The 4-bit moments in the native pass (fused blocks and tiles) against the torch
    # path, bit for bit: every strategy with Adam/AdamW/amsgrad, SGD and Lion, values
    # from 1e-38 to 1e30 with zero blocks and specials, odd lengths (a half-used last
    # byte, a partial last block), one or two threads over small work items.
    strategy = data.draw(st.sampled_from(STRATEGIES), "strategy")
    rule = data.draw(st.sampled_from(["adamw", "adamw-amsgrad", "sgd", "lion"]), "rule")
    sizes = data.draw(st.lists(st.integers(32, 700), min_size=1, max_size=3), "sizes")
    threads = data.draw(st.sampled_from([1, 2]), "threads")
    seed = data.draw(st.integers(0, 2**16), "seed")

    def run(impl: str) -> Any:
        gen = torch.Generator().manual_seed(seed)
        params = {f"p{i}": _wide(gen, n).bfloat16() for i, n in enumerate(sizes)}
        masters = mpfunc.init_master(params, strategy=strategy, seed=5)
        opt = _wide_rule(rule, U4, impl)
        state = opt.init(masters)
        kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
        for _ in range(3):
            grads = {k: _wide(gen, v.numel()).bfloat16() for k, v in params.items()}
            masters, state = mpfunc.apply_update_(masters, grads, state, opt, **kw)
        return params, masters, state

    from mpfunc.backends import _native

    real = _adam._composed
    calls: list[int] = []
    rule_step = _native.rule_step
    monkeypatch.setattr(_native, "rule_step", lambda *a: calls.append(0) or rule_step(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    old = native._tune(64 if threads > 1 else 1 << 15, False)  # items of 64: threads split leaves
    try:
        want = run("fused" if rule.startswith("adamw") else "foreach")
        assert not calls
        monkeypatch.setattr(_adam, "_composed", lambda *a: calls.append(1) or real(*a))
        got = run("auto")
    finally:
        native._tune(*old)
        torch.set_num_threads(before)
    assert_trees_bits_equal(got, want, nan_payload=False)
    assert calls, "the native pass never ran"


def test_native_refuses_wrong_4bit_codes_before_writing(native: Any) -> None:
    # Packed codes are flat, (numel + 1) // 2 bytes, int8 for the first moment and uint8
    # for the second: anything else is refused before a byte is written.
    p = torch.randn(65).bfloat16()
    g = torch.randn(65).bfloat16()
    m, v = torch.zeros(33, dtype=torch.int8), torch.zeros(33, dtype=torch.uint8)
    sm, sv = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)
    step = torch.zeros(())
    before = snapshot([p, m, v, sm, sv, step])
    args = dict(lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                decoupled=True, amsgrad=False, maximize=False, grad_scale=None,
                found_inf=None)  # fmt: skip
    for data, match in [
        ([[m[:32]], [v]], r"at \[0\]: state: expected 33 contiguous packed bytes"),
        ([[m], [v.view(3, 11)]], r"at \[0\]: state: expected 33 contiguous packed bytes"),
        ([[m.view(torch.uint8)], [v]], r"at \[0\]: state: unexpected"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            native.step_composed_(4, 3, [p], [], [g], data, [[sm], [sv]], [step], [], [0],
                                  *args.values())  # fmt: skip
    assert_unchanged([p, m, v, sm, sv, step], before)


# Where the CPU has AVX512_BF16, the native pass rounds to bf16 with one instruction that
# reads subnormal inputs as zero and keeps NaN payloads; blocks holding either must take
# torch's conversion. Values that land on them in every bf16 store of a pass: params and
# masters ("none", "kahan", "fp32"'s rounded params), Kahan compensations, bf16 moments.
# As bits, so that no float conversion flushes them under denormals-are-zero. Subnormals
# (1e-39, -3e-40, 2**-130, 5e-41, and 0x007FFFFF, the largest, which rounds up to bf16's
# smallest normal) with zeros, and apart from them, in another 32-element block (a NaN in
# a block sends the whole block to torch's conversion), NaNs with payloads.
_SUBNORMAL_BITS = [0x000AE398, 0x80034447, 0x00080000, 0x00008B61, 0x00000000, 0x80000000,
                   0x007FFFFF]  # fmt: skip
_NAN_BITS = [0x7FC00000, 0xFFC00001, 0x7FA00001]


def _bits(values: list[int]) -> torch.Tensor:
    signed = [b - (1 << 32) if b >= 1 << 31 else b for b in values]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _place_tiny(x: torch.Tensor, where: int) -> None:
    """The subnormals at ``where``, the NaNs 40 places on (mod 80): in another block."""
    x[where : where + len(_SUBNORMAL_BITS)] = _bits(_SUBNORMAL_BITS)
    nan_at = (where + 40) % 80
    x[nan_at : nan_at + len(_NAN_BITS)] = _bits(_NAN_BITS)


@pytest.mark.parametrize(
    "strategy, state_dtype",
    [("none", torch.bfloat16), ("kahan", torch.bfloat16), ("kahan", None),
     ("stochastic", torch.bfloat16), ("fp32", torch.bfloat16), ("fp32", None)],
)  # fmt: skip
@pytest.mark.parametrize("where", [0, 17, 63])  # a block's first lane, its second half, a tail
@pytest.mark.parametrize("daz", [False, True], ids=["", "denormals-are-zero"])
def test_native_bf16_rounding_keeps_subnormals_and_nan(
    composed: list[int], strategy: str, state_dtype: Any, where: int, daz: bool
) -> None:
    """Bits equal the torch path's, NaN payloads included (torch writes 0xFFFF), also with
    the CPU's denormals-are-zero flag on (``torch.set_flush_denormal``), under which the
    arithmetic reads subnormals as zero on both paths but torch's bf16 conversion, on the
    bits, still rounds them. That flag is per thread: it is set on this one, and torch's
    pool threads, started earlier without it, would run torch's fused kernel on flushed
    and unflushed values alike, so the flagged case runs on one thread."""
    threads = torch.get_num_threads()
    if daz:
        torch.set_num_threads(1)
        if not torch.set_flush_denormal(True):
            torch.set_num_threads(threads)
            pytest.skip("this CPU has no denormals-are-zero flag")
    try:
        _bf16_rounding_case(composed, strategy, state_dtype, where)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _bf16_rounding_case(composed: list[int], strategy: str, state_dtype: Any, where: int) -> None:
    def run(impl: str) -> Any:
        gen = torch.Generator().manual_seed(where)
        base = torch.randn(96, generator=gen)
        p = base.clone()
        _place_tiny(p, where)
        params = {"w": p.to(torch.bfloat16)}
        masters = mpfunc.init_master(params, strategy=strategy, seed=1)
        if strategy == "fp32":
            # Subnormal masters and their params (Tensor.to's rounding of them), so that the
            # pass's refresh check rounds them as they are, before any arithmetic (which
            # reads them as zero under denormals-are-zero).
            _place_tiny(masters["w"], where)
            params["w"].copy_(masters["w"].to(torch.bfloat16))
        opt = mpfunc.adamw(lr=1e-3, weight_decay=0.0, state_dtype=state_dtype, impl=impl)
        state = opt.init(masters)
        kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
        for k in range(3):
            g = torch.randn(96, generator=gen) * 1e-38  # subnormal first moments
            g[where + k] = float("nan") if k == 2 else 3e-39
            masters, state = mpfunc.apply_update_(masters, {"w": g.bfloat16()}, state, opt, **kw)
        return params, masters, state

    composed.clear()
    want = run("fused")
    assert not composed
    got = run("auto")
    # The native pass ran ("fp32" masters with fp32 moments take the plain native kernel).
    assert composed or (strategy == "fp32" and state_dtype is None)
    assert_trees_bits_equal(got, want)


@pytest.mark.parametrize("sd", [torch.uint8, torch.uint4], ids=["uint8", "uint4"])  # type: ignore[attr-defined]
def test_second_moment_codes_at_sqrts_torch_rounds_off(composed: list[int], sd: Any) -> None:
    """torch's CPU sqrt is 1 ulp off for about a fifth of fp32 inputs: the torch path's
    encode of ``sqrt(v)`` flipped a stochastic code about once in a million elements a
    step, against the native pass's correctly rounded sqrt. A million elements, 3 steps."""
    x = torch.tensor([966807935], dtype=torch.int32).view(torch.float32)
    assert int(mpfunc.state_formats._quantize.sqrt_rn(x).view(torch.int32)) == 1016021034
    out = []
    for impl in ("auto", "fused"):
        gen = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(1 << 20, generator=gen).to(torch.bfloat16)}
        masters = mpfunc.init_master(params)
        opt = mpfunc.adamw(lr=1e-3, impl=impl, state_dtype=sd)
        state = opt.init(masters)
        for _ in range(3):
            g = {"w": torch.randn(1 << 20, generator=gen).to(torch.bfloat16)}
            mpfunc.apply_update_(masters, g, state, opt, params=params)
        out.append((masters, state, params))
    assert composed, "the native pass did not run"
    assert_trees_bits_equal(out[0], out[1])


@pytest.mark.parametrize("strategy", ["fp32", "remainder", "kahan", "stochastic", "none"])
@pytest.mark.parametrize("sd", [None, torch.bfloat16])  # (8-bit: no empty leaves)
def test_zero_size_leaves_of_any_strides(strategy: str, sd: Any) -> None:
    """An empty leaf is contiguous whatever its strides, so it was planned into the native
    pass, whose own check then refused it (no path named) after a leaf on the torch path
    had stepped. Empty leaves step on the torch path (their count counts); the step equals
    the torch path's, bit for bit."""
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    out = []
    for impl in ("auto", "fused"):
        params = {
            "a": torch.ones(8, 64, dtype=dtype)[:, ::2],  # not dense: the torch path
            "b": torch.linspace(-1, 1, 64, dtype=dtype),
            "z": torch.empty(5, 0, dtype=dtype).t(),  # strides (1, 0)
        }
        grads = {
            "a": torch.full((8, 32), 0.5, dtype=dtype),
            "b": torch.full((64,), -0.25, dtype=dtype),
            "z": torch.empty(0, 5, dtype=dtype),
        }
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = mpfunc.adamw(lr=0.1, impl=impl, state_dtype=sd)
        state = opt.init(masters)
        for _ in range(2):
            mpfunc.apply_update_(masters, grads, state, opt)
        assert float(state.step["z"]) == 2.0
        out.append((masters, state))
    assert_trees_bits_equal(out[0], out[1])


@pytest.mark.parametrize("sd", [None, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_param_written_to_the_other_zero(sd: Any, sign: float) -> None:
    """The param is the truth, compared by value on every path: a param written from one
    zero to the other keeps its master. The torch path compared bits (the master took
    -0.0), the native pass and XLA values."""
    out = []
    for impl in ("auto", "fused"):
        params = {"w": torch.full((64,), sign * 0.0, dtype=torch.bfloat16)}
        params["w"][::3] = 0.5
        masters = mpfunc.init_master(params)
        opt = mpfunc.adamw(lr=1e-2, impl=impl, state_dtype=sd)
        state = opt.init(masters)
        with torch.no_grad():
            params["w"].neg_()
        grads = {"w": torch.zeros(64, dtype=torch.bfloat16)}
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        out.append((masters, state, params))
    assert_trees_bits_equal(out[0], out[1])
