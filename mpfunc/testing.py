"""Test your own training loop's numerics on the CPU, and its compile stability on XLA:CPU.

Three tools, the ones mpfunc's own tests use:

* **hypothesis strategies** for parameter and grad trees: nested dicts, lists, tuples and
  NamedTuples of tensors drawn from a small fixed catalog of shapes (so XLA's compile
  cache hits), in the layouts people really have (contiguous, transposed, channels_last,
  sliced, offset views, 0-d; grads also expanded), low-precision dtypes, ``None`` holes
  and integer leaves; values from a seeded normal at a drawn scale, or arbitrary bit
  patterns (subnormals, infinities, NaN, rounding ties). hypothesis is an optional
  dependency (``pip install mpfunc[test]``); the strategies raise a clear ``ImportError``
  without it, and the rest of this module does not need it.
* ``assert_steps_agree``: two training steps (yours and a reference, e.g. torch.optim on
  fp32 copies) stay within a stated bound over N steps, leaf by leaf.
* ``xla_step_report``: a step function's compiles, graphs, device-to-host transfers and
  ``aten::`` CPU fallbacks per step on XLA (from ``torch_xla.debug.metrics``), so a loop
  can be proven compile-stable on XLA:CPU in CI before it meets a TPU.

Example::

    from hypothesis import given
    import mpfunc.testing as mt

    @given(params=mt.param_trees(), data=hypothesis.strategies.data())
    def test_my_step(params, data):
        grads = data.draw(mt.grad_trees(params))
        mt.assert_steps_agree(lambda i: my_step(...), lambda i: reference_step(...), steps=5)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from mpfunc.core import _tree

__all__ = [
    "GRAD_LAYOUTS",
    "LAYOUTS",
    "LOW_DTYPES",
    "SHAPES",
    "Agreement",
    "Pair",
    "StepMetrics",
    "XlaReport",
    "assert_steps_agree",
    "bit_trees",
    "bits_tensor",
    "grad_trees",
    "in_layout",
    "param_trees",
    "tree_shapes",
    "xla_step_report",
]

# Shapes from a small fixed catalog: on XLA each new shape compiles a new graph.
SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (1,), (7,), (3, 5), (2, 3, 4), (2, 3, 2, 2), (64,))
LOW_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# Layouts a parameter can have; a layout that does not fit a shape falls back to contiguous.
LAYOUTS: tuple[str, ...] = ("contiguous", "transposed", "channels_last", "sliced", "offset")
# Grads may also be expanded (stride 0): a broadcast grad is read, never written.
GRAD_LAYOUTS: tuple[str, ...] = (*LAYOUTS, "expanded")


def _hypothesis() -> Any:
    try:
        from hypothesis import strategies
    except ImportError:
        raise ImportError(
            "mpfunc.testing's strategies need hypothesis: pip install hypothesis (or mpfunc[test])"
        ) from None
    return strategies


class Pair(NamedTuple):
    """A NamedTuple node for drawn trees (NamedTuples are nodes with named fields)."""

    weight: Any
    bias: Any


# --- tensors -----------------------------------------------------------------------------


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``x`` in ``layout``: ``"contiguous"``, ``"transposed"`` (the last two
    dimensions' strides swapped), ``"channels_last"`` (4-d), ``"sliced"`` (every other
    element of a wider tensor: not dense), ``"offset"`` (a view into a larger buffer),
    ``"expanded"`` (a stride-0 broadcast of ``x``'s first row: values change). Layouts
    that do not fit ``x``'s shape (or size) give a contiguous copy."""
    x = x.contiguous()
    if layout == "transposed" and x.ndim >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "channels_last" and x.ndim == 4:
        return x.to(memory_format=torch.channels_last)
    if layout == "sliced" and x.ndim >= 1 and x.numel() > 0:
        wide = torch.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "offset" and x.numel() > 0:
        buf = torch.zeros(x.numel() + 3, dtype=x.dtype, device=x.device)
        buf[3:] = x.flatten()
        return buf[3:].view(x.shape)
    if layout == "expanded" and x.ndim >= 1 and x.shape[0] > 1:
        return x[:1].expand(x.shape)
    if layout not in GRAD_LAYOUTS:
        raise ValueError(f"in_layout: expected one of {', '.join(GRAD_LAYOUTS)}, got {layout!r}")
    return x


def bits_tensor(draw: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inside ``@composite``: a tensor of arbitrary bit patterns of ``dtype`` (16 or 32
    bits), specials (zeros, subnormals, infinities, NaN, bf16 rounding ties) weighted in."""
    st = _hypothesis()
    n = 1
    for s in shape:
        n *= s
    if dtype.itemsize == 2:
        specials = [0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7C00, 0x7FC0, 0x03FF]
        vals = draw(
            st.lists(
                st.one_of(st.sampled_from(specials), st.integers(0, 0xFFFF)), min_size=n, max_size=n
            )
        )
        raw = torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in vals], dtype=torch.int16)
    else:
        # fp32 values exactly on a bf16 rounding tie (low 16 bits 0x8000), next to one,
        # subnormals, infinities and NaNs, plus arbitrary patterns.
        specials = [
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0x00008000,
            0x00000001,
            0x807FFFFF,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7F800001,
            0x7F7FFFFF,
            0x7F7F8000,
            0x3F807FFF,
            0x3F808001,
            0x33800000,
        ]
        vals = draw(
            st.lists(
                st.one_of(st.sampled_from(specials), st.integers(0, 0xFFFFFFFF)),
                min_size=n,
                max_size=n,
            )
        )
        raw = torch.tensor([v - 0x100000000 if v >= 0x80000000 else v for v in vals]).to(
            torch.int32
        )
    return raw.view(dtype).reshape(shape)


# --- trees -------------------------------------------------------------------------------


def tree_shapes(
    leaves: Any, *, none_holes: bool = True, int_leaves: bool = True, max_leaves: int = 6
) -> Any:
    """A strategy nesting ``leaves`` in dicts, lists, tuples and ``Pair`` NamedTuples, with
    the odd ``None`` and integer/bool leaf. Containers are never empty, and most leaves
    are drawn from ``leaves``."""
    st = _hypothesis()
    extras = [
        *([None] if none_holes else []),
        *([torch.arange(3), torch.tensor([True, False])] if int_leaves else []),
    ]
    base = (
        st.one_of(leaves, leaves, leaves, leaves, leaves, st.sampled_from(extras))
        if extras
        else leaves
    )
    return st.recursive(
        base,
        lambda children: st.one_of(
            st.dictionaries(
                st.sampled_from(["w", "b", "emb", "ln"]), children, min_size=1, max_size=3
            ),
            st.lists(children, min_size=1, max_size=3),
            st.tuples(children, children),
            st.builds(Pair, children, children),
        ),
        max_leaves=max_leaves,
    )


def _normal(seed: int, shape: tuple[int, ...], scale: float, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def param_trees(
    dtypes: Sequence[torch.dtype] = LOW_DTYPES,
    *,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    layouts: Sequence[str] = LAYOUTS,
    none_holes: bool = True,
    int_leaves: bool = True,
    bits: bool = False,
    device: torch.device | str = "cpu",
    max_leaves: int = 6,
) -> Any:
    """A strategy for parameter trees.

    Each floating leaf has a shape from ``shapes``, a dtype from ``dtypes`` and a layout
    from ``layouts``; its values are normal at a scale drawn from 1e-3 to 1e2 (seeded,
    so they shrink by seed), or arbitrary bit patterns with ``bits=True``. With
    ``none_holes``/``int_leaves`` some leaves are ``None`` or int/bool tensors (no master).
    Leaves are moved to ``device`` (XLA keeps values, not strides).
    """
    st = _hypothesis()

    def leaf(draw: Any) -> torch.Tensor:
        shape = draw(st.sampled_from(list(shapes)))
        dtype = draw(st.sampled_from(list(dtypes)))
        if bits:
            x = bits_tensor(draw, shape, dtype)
        else:
            scale = draw(st.sampled_from([1e-3, 1e-1, 1.0, 1e2]))
            x = _normal(draw(st.integers(0, 2**31 - 1)), shape, scale, dtype)
        return in_layout(x, draw(st.sampled_from(list(layouts)))).to(device)

    return tree_shapes(
        st.composite(leaf)(), none_holes=none_holes, int_leaves=int_leaves, max_leaves=max_leaves
    )


def grad_trees(
    params: Any,
    *,
    dtype: torch.dtype | None = None,
    layouts: Sequence[str] = GRAD_LAYOUTS,
    none_holes: bool = True,
    scales: Sequence[float] = (1e-5, 1e-2, 1.0, 1e2),
) -> Any:
    """A strategy for grads of ``params``: the same structure, a grad for every floating
    leaf (in ``dtype``, default the param's own) of the param's shape and device, in a
    layout from ``layouts``, at one drawn scale; ``None`` where the param is not
    floating, and, with ``none_holes``, for some floating params too (params that took no
    grad, which optimizers skip), never all of them (a step with no grad at all is an
    error: the backward was forgotten)."""
    st = _hypothesis()
    leaves, spec = _tree.flatten(params)
    floating = [
        i for i, p in enumerate(leaves) if isinstance(p, torch.Tensor) and p.is_floating_point()
    ]

    def grads(draw: Any) -> Any:
        scale = draw(st.sampled_from(list(scales)))
        kept = draw(st.sampled_from(floating)) if floating and none_holes else None
        out: list[Any] = []
        for i, p in enumerate(leaves):
            if not (isinstance(p, torch.Tensor) and p.is_floating_point()):
                out.append(None)
                continue
            if none_holes and i != kept and draw(st.integers(0, 5)) == 0:
                out.append(None)
                continue
            x = _normal(draw(st.integers(0, 2**31 - 1)), tuple(p.shape), scale, dtype or p.dtype)
            out.append(in_layout(x, draw(st.sampled_from(list(layouts)))).to(p.device))
        return _tree.unflatten(spec, out)

    return st.composite(grads)()


def bit_trees(
    dtype: torch.dtype | None = None, *, shapes: Sequence[tuple[int, ...]] = SHAPES
) -> Any:
    """A strategy for trees of arbitrary-bit low-precision tensors (contiguous), with
    ``None`` and int leaves mixed in: for properties of casts."""
    return param_trees(
        LOW_DTYPES if dtype is None else (dtype,), shapes=shapes, layouts=("contiguous",), bits=True
    )


# --- agreement of two training steps ---------------------------------------------------------


class Agreement(NamedTuple):
    """What ``assert_steps_agree`` measured: the worst ratio of error to bound over all
    steps and leaves (<= 1 passes), and where it was."""

    steps: int
    worst_ratio: float
    worst_path: str
    worst_step: int


def _settle(tensors: Sequence[Any]) -> None:
    # On XLA, run pending work before reading back (torch_xla can answer a read from a
    # cached graph of the same shape otherwise).
    if any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in tensors):
        import torch_xla

        torch_xla.sync()


def assert_steps_agree(
    step: Callable[[int], Any],
    reference: Callable[[int], Any],
    steps: int,
    *,
    rtol: float = 1e-6,
    atol: float = 0.0,
) -> Agreement:
    """Runs ``step(i)`` and ``reference(i)`` for ``i`` in ``range(steps)``; each returns a
    tree to compare (masters, params, state...). After every step, leaf by leaf::

        max|a - b| <= rtol * M + atol

    where ``M`` is the largest finite magnitude the reference leaf has reached so far
    (mpfunc's own bound against torch.optim is ``rtol=1e-6``). Trees must match in
    structure; non-floating leaves (Python values included) and ``None`` must be equal;
    NaN matches only NaN, and an infinity only the same infinity; complex leaves are
    compared in both parts.

    Returns:
      An ``Agreement`` (the worst error/bound ratio and where).

    Raises:
      AssertionError: naming the step, the leaf's path, the error and the bound.
    """
    worst = Agreement(steps, 0.0, "", -1)
    peak: dict[int, float] = {}
    for i in range(steps):
        a, b = step(i), reference(i)
        la, sa = _tree.flatten(a)
        lb, sb = _tree.flatten(b)
        if sa != sb:
            raise AssertionError(f"step {i}: the trees differ in structure: {sa} vs {sb}")
        _settle([*la, *lb])
        paths = None
        for k, (x, y) in enumerate(zip(la, lb)):
            if x is None or y is None or not isinstance(x, torch.Tensor):
                # None, and anything not a tensor (a returned Python loss): equal, or an
                # error (a non-tensor leaf passed unread before: found in review).
                same = (x is None) == (y is None) and (
                    x is None or (type(x) is type(y) and (x == y or (x != x and y != y)))
                )
                if not same:
                    paths = paths or _tree.leaf_paths(a)
                    raise AssertionError(f"step {i}: at {paths[k]!r}: {x!r} vs {y!r}")
                continue
            if x.is_complex() or y.is_complex():  # compared as their two real parts
                x, y = torch.view_as_real(x.resolve_conj()), torch.view_as_real(y.resolve_conj())
            x64, y64 = x.detach().cpu().double(), y.detach().cpu().double()
            if x64.shape != y64.shape:
                paths = paths or _tree.leaf_paths(a)
                raise AssertionError(f"step {i}: at {paths[k]!r}: shapes {x.shape} vs {y.shape}")
            if not x.is_floating_point():
                if not torch.equal(x64, y64):
                    paths = paths or _tree.leaf_paths(a)
                    raise AssertionError(f"step {i}: at {paths[k]!r}: integer leaves differ")
                continue
            if not torch.equal(x64.isnan(), y64.isnan()):
                paths = paths or _tree.leaf_paths(a)
                raise AssertionError(f"step {i}: at {paths[k]!r}: NaN in one step only")
            # An infinity matches only the same infinity, and takes no part in the bound:
            # as the largest magnitude it made every bound infinite, and inf - inf a NaN
            # error that compared as no error (found in review).
            infinite = y64.isinf() | x64.isinf()
            if not torch.equal(x64[infinite], y64[infinite]):
                paths = paths or _tree.leaf_paths(a)
                raise AssertionError(f"step {i}: at {paths[k]!r}: an infinity in one step only")
            finite = y64.isfinite() & x64.isfinite()
            if x64.numel() == 0 or not bool(finite.any()):
                continue
            peak[k] = max(peak.get(k, 0.0), float(y64[finite].abs().max()))
            err = float((x64[finite] - y64[finite]).abs().max())
            bound = rtol * peak[k] + atol
            ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
            if ratio > worst.worst_ratio:
                paths = paths or _tree.leaf_paths(a)
                worst = Agreement(steps, ratio, paths[k], i)
            if ratio > 1:
                raise AssertionError(
                    f"step {i}: at {worst.worst_path!r}: max|a - b| = {err:.3g} exceeds the "
                    f"bound {bound:.3g} (rtol {rtol:g} x largest magnitude {peak[k]:.3g} + "
                    f"atol {atol:g})"
                )
    return worst


# --- XLA metrics per step ---------------------------------------------------------------------


class StepMetrics(NamedTuple):
    """One measured step on XLA."""

    compiles: int  # new graphs compiled
    graphs: int  # graphs executed
    transfers_to_host: int  # device-to-host reads (.item(), printing, Python branches)
    fallbacks: dict[str, int]  # aten:: ops that ran on the CPU, and how often


class XlaReport(NamedTuple):
    """``xla_step_report``'s result: warm-up steps were run first and not measured."""

    warmup: int
    steps: list[StepMetrics]

    def problems(self, graphs_per_step: int = 1) -> list[str]:
        out = []
        for i, s in enumerate(self.steps, start=self.warmup):
            if s.compiles:
                out.append(f"step {i} compiled {s.compiles} new graph(s)")
            if s.graphs != graphs_per_step:
                out.append(f"step {i} ran {s.graphs} graphs (expected {graphs_per_step})")
            if s.transfers_to_host:
                out.append(f"step {i} read {s.transfers_to_host} time(s) from the device")
            if s.fallbacks:
                out.append(f"step {i} fell back to the CPU for {s.fallbacks}")
        return out

    def assert_stable(self, graphs_per_step: int = 1) -> None:
        """Raises ``AssertionError`` listing every measured step that compiled, ran other
        than ``graphs_per_step`` graphs, read from the device or fell back to the CPU."""
        problems = self.problems(graphs_per_step)
        if problems:
            raise AssertionError("the step is not stable on XLA: " + "; ".join(problems))


def _metrics() -> Any:
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        raise ImportError(
            "xla_step_report needs torch_xla (pip install mpfunc[xla]); run with PJRT_DEVICE=CPU "
            "to test on the CPU"
        ) from None
    return met


def _snapshot(met: Any) -> tuple[int, int, int, dict[str, int]]:
    def count(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    aten = {n: int(met.counter_value(n)) for n in met.counter_names() if n.startswith("aten::")}
    return count("CompileTime"), count("ExecuteTime"), count("TransferFromDeviceTime"), aten


def xla_step_report(step: Callable[[int], Any], *, steps: int = 10, warmup: int = 2) -> XlaReport:
    """Runs ``step(i)`` ``warmup`` times, then ``steps`` more times, measuring each of the
    latter with ``torch_xla.debug.metrics``. After each call the pending graph is run
    (``torch_xla.sync()``) and awaited, so a step is whatever ``step`` traces; ``step``
    may sync itself. A compile-stable loop shows 0 compiles, 1 graph, 0 transfers and
    no fallbacks per measured step (``report.assert_stable()``).
    """
    met = _metrics()
    import torch_xla
    import torch_xla.core.xla_model as xm

    def run(i: int) -> None:
        step(i)
        torch_xla.sync()
        xm.wait_device_ops()  # execution is asynchronous: wait so the counts are current

    for i in range(warmup):
        run(i)
    measured = []
    for i in range(warmup, warmup + steps):
        c0, e0, t0, f0 = _snapshot(met)
        run(i)
        c1, e1, t1, f1 = _snapshot(met)
        fell = {n: v - f0.get(n, 0) for n, v in f1.items() if v != f0.get(n, 0)}
        measured.append(StepMetrics(c1 - c0, e1 - e0, t1 - t0, fell))
    return XlaReport(warmup, measured)
