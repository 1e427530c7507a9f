"""A run with ``"remainder"`` masters is an ``"fp32"`` run, bit for bit, ties included.

Both runs get the same bf16 grads; after every step the params, the masters (the
remainder's joined) and the optimizer state are compared bit for bit, for AdamW, SGD and
Lion on every layout. The inputs are chosen so that updates land on exact bf16 halves
(values in [1, 2), a power-of-two lr, grads of +-1): the test counts the element-steps
whose master sat on a tie and asserts there were some, so the tie bit is exercised, not
merely present. Old checkpoints (written with ties-away params, no tie bits:
``tests/fixtures/remainder_v1.pt``) load into today's encoding with the same masters.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_bits_equal, bits, leaves, pruned_run

import mpfunc
from mpfunc.strategies import _remainder

BF16 = torch.bfloat16
FIXTURES = Path(__file__).parent / "fixtures"

# (layout, shape): the param is made contiguous of ``shape`` and then laid out.
LAYOUTS = [
    ("contiguous", (2, 16)),
    ("contiguous", (37,)),
    ("transposed", (16, 3)),
    ("channels_last", (2, 3, 2, 8)),
    ("sliced", (3, 10)),
    ("0-d", ()),
]


def _laid(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "transposed":
        return x.t().contiguous().t()
    if kind == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if kind == "sliced":
        wide = torch.zeros(x.shape[0], x.shape[1] * 2, dtype=x.dtype, device=x.device)
        wide[:, ::2] = x
        return wide[:, ::2]
    return x


def _params(
    layouts: list[tuple[str, tuple[int, ...]]], seed: int, device: torch.device
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (kind, shape) in enumerate(layouts):
        # Values in [1, 2) on the bf16 grid: an lr of 2**-8 moves them by half an ulp.
        k = torch.randint(0, 128, shape, generator=gen)
        x = (1.0 + k.float() * 2.0**-7).to(BF16).to(device)
        out[f"p{i}"] = torch.nn.Parameter(_laid(kind, x))
    return out


def _grads(
    params: dict[str, torch.Tensor], gen: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    out = {}
    for k, p in params.items():
        sign = torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1
        scale = torch.where(torch.rand(p.shape, generator=gen) < 0.8, 1.0, 0.75)
        out[k] = (sign * scale).to(BF16).to(device)
    return out


def _ties(masters: dict[str, Any]) -> int:
    """Element-steps on a tie: masters whose low half is exactly 0x8000."""
    n = 0
    for m in masters.values():
        low = bits(m.remainder).to(torch.int32) & 0xFFFF
        n += int((low == 0x8000).sum())
    return n


def _optimizer(name: str, impl: str, state_dtype: torch.dtype | None = None) -> Any:
    lr = 2.0**-8
    sd = state_dtype
    if name == "adamw":
        return mpfunc.adamw(lr=lr, weight_decay=0.0, impl=impl, state_dtype=sd)
    if name == "sgd":
        return mpfunc.sgd(lr=lr, impl=impl, state_dtype=sd)
    if name == "sgd_momentum":
        return mpfunc.sgd(lr=lr, momentum=0.5, impl=impl, state_dtype=sd)
    return mpfunc.lion(lr=lr, impl=impl, state_dtype=sd)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (any dtype, any shape), on the CPU."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def run(
    device: torch.device, name: str, impl: str, layouts: list[Any], seed: int, steps: int
) -> int:
    """Runs both and compares at every step; returns the element-steps on a tie."""
    opt = _optimizer(name, impl)
    p32, prem = _params(layouts, seed, device), _params(layouts, seed, device)
    m32 = mpfunc.init_master(p32)
    mrem = mpfunc.init_master(prem, strategy="remainder")
    s32, srem = opt.init(m32), opt.init(mrem)
    gen = torch.Generator().manual_seed(seed + 1)
    ties = 0
    for _ in range(steps):
        grads = _grads(p32, gen, device)
        mpfunc.apply_update_(m32, grads, s32, opt, params=p32)
        mpfunc.apply_update_(mrem, grads, srem, opt)
        _sync(device)
        ties += _ties(mrem)
        for k in p32:
            assert_bits_equal(prem[k], p32[k])  # the param is Tensor.to's, every step
        exported = mpfunc.masters_state_dict(mrem)
        for k in p32:
            assert_bits_equal(exported[k], m32[k])
        for a, b in zip(leaves(s32), leaves(srem), strict=True):
            if a is not None or b is not None:
                assert_bits_equal(a, b)
    return ties


OPTIMIZERS = ["adamw", "sgd", "sgd_momentum", "lion"]


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(OPTIMIZERS),
    impl=st.sampled_from(["auto", "foreach"]),
    layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_remainder_run_is_the_fp32_run_cpu(
    name: str, impl: str, layouts: list[Any], seed: int
) -> None:
    ties = run(torch.device("cpu"), name, impl, layouts, seed, steps=6)
    # Updates of exactly +-lr (a grad of +-1, 80% of the draws) move a param by half an ulp:
    # with 8 elements or more some step lands on a tie (one 0-d param alone may miss them
    # all in 6 steps: seed 1001 did; its bits are still compared at every step above).
    elements = sum(math.prod(shape) for _, shape in layouts)
    if name in ("sgd", "lion") and elements >= 8:
        assert ties > 0, "no step landed on a tie"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_lands_on_ties_cpu(name: str) -> None:
    """Each optimizer on every layout at once, with the native pass where it applies."""
    ties = run(torch.device("cpu"), name, "auto", LAYOUTS, seed=7, steps=8)
    if name in ("sgd", "lion"):
        assert ties > 0


@pytest.mark.xla
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_remainder_run_is_the_fp32_run_xla(xla_device: torch.device, name: str) -> None:
    ties = run(xla_device, name, "auto", LAYOUTS, seed=7, steps=4)
    if name in ("sgd", "lion"):
        assert ties > 0


def test_cpu_and_xla_tie_bits_agree_on_a_run(xla_device: torch.device) -> None:
    """The same run on the CPU and on XLA: the same params, remainders and tie bits."""
    out = []
    for device in (torch.device("cpu"), xla_device):
        opt = mpfunc.sgd(lr=2.0**-8)
        p = _params(LAYOUTS, 3, device)
        m = mpfunc.init_master(p, strategy="remainder")
        s = opt.init(m)
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            mpfunc.apply_update_(m, _grads(p, gen, device), s, opt)
        _sync(device)
        out.append({k: [t.detach().cpu() for t in u] for k, u in m.items()})
    for k in out[0]:
        for a, b in zip(out[0][k], out[1][k]):
            assert torch.equal(_raw(a), _raw(b)), k


test_cpu_and_xla_tie_bits_agree_on_a_run = pytest.mark.xla(test_cpu_and_xla_tie_bits_agree_on_a_run)


# --- checkpoints -------------------------------------------------------------------------------


def _v1() -> dict[str, Any]:
    return torch.load(FIXTURES / "remainder_v1.pt", weights_only=True)


def test_sidecar_round_trips_with_tie_bits(tmp_path: Path) -> None:
    v1 = _v1()
    params = {k: torch.nn.Parameter(v.to(BF16)) for k, v in v1["fp32"].items()}
    m = mpfunc.init_master(params, strategy="remainder")
    for k, v in v1["fp32"].items():
        _remainder.split_([v], [m[k].param], [m[k].remainder], [m[k].ties])
    side = mpfunc.remainders_state_dict(m)
    want = [
        *v1["fp32"],
        *(k + "#ties" for k in v1["fp32"]),
        *(k + "#param_crc32" for k in v1["fp32"]),
    ]
    assert sorted(side) == sorted(want)
    torch.save(side, tmp_path / "side.pt")
    sd = {k: p.detach().clone() for k, p in params.items()}
    back = mpfunc.masters_from_remainders(sd, torch.load(tmp_path / "side.pt", weights_only=True))
    for k, v in v1["fp32"].items():
        assert_bits_equal(back[k], v)
        nan = torch.isnan(v)
        assert torch.equal(bits(sd[k])[~nan], bits(v.to(BF16))[~nan])


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0,), (3, 0, 5)])
def test_an_empty_param_exports_and_round_trips(shape: tuple[int, ...]) -> None:
    """A zero-size param (an empty embedding, a 0-row slice) beside a real one: the tie
    bits were unpacked with reshape(..., -1), which torch refuses for 0 elements, so
    masters_state_dict and masters_from_remainders raised torch's reshape error."""
    params = {"e": torch.zeros(shape, dtype=BF16), "w": torch.randn(3, 9).to(BF16)}
    m = mpfunc.init_master(params, strategy="remainder")
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(m)
    mpfunc.apply_update_(m, {k: torch.randn(v.shape) for k, v in params.items()}, state, opt)
    sd = mpfunc.masters_state_dict(m)
    assert sd["e"].shape == shape and sd["e"].dtype == torch.float32
    back = mpfunc.masters_from_remainders(params, mpfunc.remainders_state_dict(m))
    for k in params:
        assert_bits_equal(back[k], sd[k])


def test_checkpoint_keys_that_print_alike_are_refused() -> None:
    """Keys 1 and '1' both print as '1': masters_state_dict kept one of the two leaves and
    dropped the other without a word. Every state_dict refuses the collision."""
    m = mpfunc.init_master(
        {1: torch.ones(2, dtype=BF16), "1": torch.ones(3, dtype=BF16)}, strategy="remainder"
    )
    for f in (mpfunc.masters_state_dict, mpfunc.remainders_state_dict, mpfunc.state_dict):
        with pytest.raises(
            ValueError, match=r"two leaves have the same key '1(\.param)?'.*\(1 and '1'\)"
        ):
            f(m)


def test_old_sidecar_loads_by_the_old_rule() -> None:
    """A sidecar written before tie bits, beside its ties-away params: the same masters."""
    v1 = _v1()
    back = mpfunc.masters_from_remainders(v1["model"], v1["sidecar"])
    for k, v in v1["fp32"].items():
        assert_bits_equal(back[k], v)
    # The old params differ from today's at the even ties: the file really is old.
    p = v1["model"]["specials"]
    assert (
        int(bits(p)[0]) == 0x3F81
        and int(bits(_remainder.split(v1["fp32"]["specials"])[0])[0]) == 0x3F80
    )


def test_old_master_optimizer_state_loads_and_resplits() -> None:
    """A MasterOptimizer state_dict from before tie bits (no ``ties`` entries), loaded after
    the model's own old state_dict: every master is the saved one, the params are now
    ``Tensor.to``'s, and the state_dict round-trips bit for bit."""
    v1 = _v1()
    model = torch.nn.Module()
    for k, v in v1["fp32"].items():
        model.register_parameter(k, torch.nn.Parameter(torch.zeros_like(v, dtype=BF16)))
    opt = mpfunc.MasterOptimizer(list(model.parameters()), lr=0.0, strategy="remainder")
    model.load_state_dict(v1["model"])
    opt.load_state_dict(v1["optimizer"])
    sd = opt.state_dict()
    names = list(dict(model.named_parameters()))
    for i, k in enumerate(names):
        entry = sd["state"][i]
        p = dict(model.named_parameters())[k]
        master = _remainder.join(p.detach(), entry["remainder"], entry["ties"])
        assert_bits_equal(master, v1["fp32"][k])
        nan = torch.isnan(master)
        assert torch.equal(bits(p)[~nan], bits(master.to(BF16))[~nan])
    opt2 = mpfunc.MasterOptimizer(list(model.parameters()), lr=0.0, strategy="remainder")
    opt2.load_state_dict(sd)
    for i in range(len(names)):
        for key, t in opt2.state_dict()["state"][i].items():
            want = sd["state"][i][key]
            assert torch.equal(_raw(t), _raw(want)), (names[i], key)


def test_old_tree_file_loads_by_the_old_rule(tmp_path: Path) -> None:
    """A ``mpfunc.save`` tree of units from before tie bits (no ``ties`` entries): its
    checksums are verified, each master is read by the old rule and split again by
    today's, so every master is the saved one, bit for bit, and every param is now
    ``Tensor.to``'s; ``load_`` writes the same into a run's own tensors."""
    v1 = _v1()
    params = {k: torch.nn.Parameter(v.to(BF16)) for k, v in v1["fp32"].items()}
    m = mpfunc.init_master(params, strategy="remainder")
    back = mpfunc.load(FIXTURES / "remainder_v1_tree.pt", like={"masters": m})["masters"]
    for k, v in v1["fp32"].items():
        u = back[k]
        master = _remainder.join(u.param, u.remainder, u.ties)
        assert_bits_equal(master, v)
        nan = torch.isnan(v)
        assert torch.equal(bits(u.param)[~nan], bits(v.to(BF16))[~nan])
    mpfunc.load_(FIXTURES / "remainder_v1_tree.pt", {"masters": m})
    for k, v in v1["fp32"].items():
        assert_bits_equal(_remainder.join(m[k].param.detach(), m[k].remainder, m[k].ties), v)
    # Saved again, the tree holds tie bits and loads by today's rule.
    mpfunc.save(tmp_path / "new.pt", {"masters": m})
    again = mpfunc.load(tmp_path / "new.pt", like={"masters": m})["masters"]
    for k in v1["fp32"]:
        for a, b in zip(again[k], m[k]):
            x, y = a.detach().reshape(-1), b.detach().reshape(-1)
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k


def test_old_tree_file_with_a_flipped_byte_is_refused() -> None:
    """The old-rule read never derives from unverified bytes: a flipped value is caught by
    the file's checksum first, and the tree is untouched."""
    v1 = _v1()
    params = {k: torch.nn.Parameter(v.to(BF16)) for k, v in v1["fp32"].items()}
    m = mpfunc.init_master(params, strategy="remainder")
    raw = bytearray((FIXTURES / "remainder_v1_tree.pt").read_bytes())
    before = {k: (bits(u.param).clone(), u.param._version) for k, u in m.items()}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "old.pt"
        # Flip one byte near the end of the file (tensor data lies before the zip directory).
        i = len(raw) // 2
        raw[i] ^= 0x40
        path.write_bytes(bytes(raw))
        with pytest.raises(ValueError):
            mpfunc.load_(path, {"masters": m})
    for k, u in m.items():
        assert torch.equal(bits(u.param), before[k][0]) and u.param._version == before[k][1]


# Leaves the native pass takes whatever their layout: odd row widths (rows of tie bytes
# padded), transposed and channels_last (the bit found through sizes and strides), 0-d, and
# long enough that two threads split them inside a row's byte.
NATIVE_LAYOUTS = [
    ("contiguous", (129, 37)),
    ("transposed", (70, 45)),
    ("channels_last", (4, 5, 9, 33)),
    ("contiguous", (1003,)),
    ("0-d", ()),
]


def _spy_native(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets one entry per call of the native pass's two step entries."""
    from mpfunc.backends import _native

    native = _native.load()
    calls: list[int] = []
    for entry in ("step_composed_", "step_rule_"):
        fn = getattr(native, entry)

        def spy(*a: Any, _fn: Any = fn) -> Any:
            calls.append(1)
            return _fn(*a)

        monkeypatch.setattr(native, entry, spy)
    return calls


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_native_pass_keeps_tie_bits_on_every_layout(
    monkeypatch: pytest.MonkeyPatch, name: str, threads: int
) -> None:
    """The native pass (impl="auto") and the torch path (its specification) give the same
    params, remainders and tie bytes at every step, on layouts where a tie bit's byte is
    not the element index / 8, and the native pass ran."""
    from mpfunc.backends import _native

    if not _native.available():
        pytest.skip("no native kernel")
    calls = _spy_native(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pa = _params(NATIVE_LAYOUTS, 3, torch.device("cpu"))
        pb = _params(NATIVE_LAYOUTS, 3, torch.device("cpu"))
        ma = mpfunc.init_master(pa, strategy="remainder")
        mb = mpfunc.init_master(pb, strategy="remainder")
        # The native pass's specification: torch's fused kernel for AdamW, else foreach.
        oa, ob = (
            _optimizer(name, "auto"),
            _optimizer(name, "fused" if name == "adamw" else "foreach"),
        )
        sa, sb = oa.init(ma), ob.init(mb)
        gen = torch.Generator().manual_seed(11)
        ties = 0
        for _ in range(6):
            grads = _grads(pa, gen, torch.device("cpu"))
            mpfunc.apply_update_(ma, grads, sa, oa)
            mpfunc.apply_update_(mb, grads, sb, ob)
            ties += int(sum(int(_raw(m.ties).any()) for m in ma.values()))
            for k in pa:
                for x, y in zip(ma[k], mb[k], strict=True):
                    assert torch.equal(_raw(x), _raw(y)), k
            for x, y in zip(leaves(sa), leaves(sb), strict=True):
                if x is not None or y is not None:
                    assert_bits_equal(x, y)
    finally:
        torch.set_num_threads(before)
    assert calls, "the native pass never ran"
    assert ties > 0, "no tie bit was ever set"


def _every_pair(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(param, remainder, tie bytes) of ``rows`` rows of 65,536: each row every bf16 param
    pattern (NaNs, infs, +-0 and subnormals included) beside remainders of one kind: 0,
    0x7FFF, 0x8000 (every element a tie), 0x8001, 0xFFFF, then random ones. Tie bits are
    random where ``join`` reads them (a 0x8000 remainder or a NaN param) and 0 elsewhere,
    as ``split`` leaves them; pairs no split writes (a -0 param with a set top bit) are
    there too, and every path must read them alike."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 << 16
    param = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).repeat(rows, 1)
    edges = [0, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
    low = torch.randint(0, n, (rows, n), generator=gen, dtype=torch.int32)
    for r, e in enumerate(edges[:rows]):
        low[r] = e
    reads = ((param.to(torch.int32) & 0x7FFF) > 0x7F80) | (low == 0x8000)
    tie = torch.randint(0, 2, (rows, n), generator=gen, dtype=torch.int32) * reads
    return param.view(BF16), low.to(torch.int16), _remainder.pack_ties(tie)


@pytest.mark.parametrize("state_dtype", [None, torch.uint8], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_native_remainder_blocks_equal_the_tiles_on_every_pair(
    monkeypatch: pytest.MonkeyPatch, name: str, threads: int, state_dtype: torch.dtype | None
) -> None:
    """The native pass's vector blocks (the common element in 16-bit lanes, the rare ones
    out of line; 8-bit moments step several blocks at a time) against its tiles
    (join/split element by element) and the torch path, on every param pattern beside
    edge and random remainders and tie bits: params, remainders and tie bytes equal bit
    for bit, NaN payloads included."""
    from mpfunc.backends import _native

    if not _native.available():
        pytest.skip("no native kernel")
    native = _native.load()
    calls = _spy_native(monkeypatch)
    rows = 6
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(rows, 1 << 16, generator=gen) * 1e-2).to(BF16) for _ in range(2)]

    def run(impl: str, tiles: bool) -> list[torch.Tensor]:
        if tiles:
            monkeypatch.setenv("MPFUNC_NATIVE_TILES", "1")
        else:
            monkeypatch.delenv("MPFUNC_NATIVE_TILES", raising=False)
        param, low, ties = _every_pair(rows, seed=5)
        params = {"w": torch.nn.Parameter(param.clone())}
        masters = mpfunc.init_master(params, strategy="remainder")
        unit = masters["w"]
        unit.remainder.copy_(low)
        unit.ties.copy_(ties)
        # The torch path's specification: torch's fused kernel for AdamW, else foreach.
        spec = "fused" if name == "adamw" else "foreach"
        opt = _optimizer(name, spec if impl == "spec" else "auto", state_dtype)
        state = opt.init(masters)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        old = native._tune(4096 if threads > 1 else 1 << 15, False)  # threads split rows
        try:
            for g in grads:
                mpfunc.apply_update_(masters, {"w": g}, state, opt)
        finally:
            native._tune(*old)
            torch.set_num_threads(before)
        return [_raw(t) for t in unit]

    blocks, tiles = run("auto", False), run("auto", True)
    assert calls, "the native pass never ran"
    calls.clear()
    spec = run("spec", False)
    assert not calls
    for a, b, c, what in zip(blocks, tiles, spec, ("param", "remainder", "ties"), strict=True):
        assert torch.equal(a, b), what
        assert torch.equal(a, c), what


def _pruned_run(device: torch.device | str, impl: str) -> list[torch.Tensor]:
    """Half the zeroed elements' remainders still say "rounded up" from the old values."""
    masters = pruned_run("remainder", device, impl, BF16, seed=11, steps=1)
    return [masters["w"].param.cpu(), mpfunc.masters_state_dict(masters)["w"].cpu()]


@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_a_zeroed_param_stays_zero_not_nan(impl: str) -> None:
    """A zero param cannot have rounded up: a remainder saying so is stale (the param was
    written) and the master is the param, +-0, as with "fp32" masters. It wrapped to NaN
    bits (0xFFFF high half) before, on every path alike."""
    param, master = _pruned_run("cpu", impl)
    assert not param.isnan().any() and not master.isnan().any()
    assert bool((param[:, :32] == 0).all())  # the zero param stays (a zero-grad step)
    assert bool(torch.signbit(param[0, :8]).all()) and not bool(torch.signbit(param[1:, :32]).any())
    # The master rounds to its param (the remainder's invariant): +-0, or a subnormal
    # below half of bf16's smallest (a remainder whose top bit was clear fits a zero).
    assert_bits_equal(master.to(BF16), param)
    assert bool((master[:, :32].abs() < 2.0**-134).all())


def test_join_of_a_stale_zero_is_the_zero() -> None:
    """join() on every remainder of +-0 params with both tie bits: +-0 wherever the pair
    says "rounded up" (top bit set, or an exact tie with the tie bit), the subnormal
    master elsewhere; the native tiles and blocks agree (the test above and
    test_native_remainder_blocks_equal_the_tiles_on_every_pair)."""
    low = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for sign in (0.0, -0.0):
        for tie in (0, 1):
            param = torch.full(low.shape, sign, dtype=BF16)
            ties = _remainder.pack_ties(torch.full(low.shape, tie, dtype=torch.int32))
            master = _remainder.join(param, low, ties)
            u = low.to(torch.int32) & 0xFFFF
            up = (u > 0x8000) | ((u == 0x8000) & (tie == 1))
            want = torch.where(up, 0, u) | (int(math.copysign(1, sign) < 0) << 31)
            assert torch.equal(master.view(torch.int32), want.to(torch.int32))


@pytest.mark.xla
def test_a_zeroed_param_stays_zero_on_xla(xla_device: torch.device) -> None:
    """As on the CPU. XLA:CPU flushes subnormals in arithmetic, so the subnormal masters
    that fit a zero param (see above) read as +-0 there: compared flushed."""
    cpu = _pruned_run("cpu", "foreach")
    got = _pruned_run(xla_device, "auto")
    assert not got[0].isnan().any() and not got[1].isnan().any()
    assert_bits_equal(got[0], cpu[0])

    def flushed(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x.abs() < 2.0**-126, x * 0, x)

    assert_bits_equal(flushed(got[1]), flushed(cpu[1]))
