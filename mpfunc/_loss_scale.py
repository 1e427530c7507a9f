"""Loss scaling as pytree state: ``StaticLossScale`` and ``DynamicLossScale``.

In the spirit of jmp: a loss scale is an immutable value. ``scale(loss)``
multiplies, ``grads_to_fp32(grads, scale=...)`` divides while upcasting, and
``adjust(finite)`` returns the next state. Every decision (back off, grow) is a
``torch.where`` on the device, so a step never waits on the host.

Both classes are optree nodes in mpfunc's namespace: their tensors are the
children (``loss_scale``, ``counter``) and their settings the node's metadata,
so flatten/unflatten (and mpfunc's checkpoints) keep every field.
"""

from __future__ import annotations

import math
from typing import Any, Union

import optree
import torch

from mpfunc import _checks, _tree

__all__ = ["DynamicLossScale", "LossScale", "ScaleArg", "StaticLossScale", "scale_value"]


def _scalar(fn: str, name: str, value: object, rule: str) -> float:
    """A finite float obeying ``rule``: ``">= 0"``, ``"> 0"``, ``"> 1"`` or ``"in (0, 1)"``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name}: expected a finite float {rule}, got {type(value).__name__}")
    value = float(value)
    ok = (
        math.isfinite(value)
        and {
            ">= 0": value >= 0.0,
            "> 0": value > 0.0,
            "> 1": value > 1.0,
            "in (0, 1)": 0.0 < value < 1.0,
        }[rule]
    )
    if not ok:
        raise ValueError(f"{fn}: {name}: expected a finite float {rule}, got {value}")
    return value


def _scale_tensor(fn: str, scale: object) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.ndim != 0 or not scale.is_floating_point():
            raise TypeError(
                f"{fn}: scale: expected a finite float > 0 or a 0-d float tensor, got "
                f"{_checks.describe(scale)}"
            )
        return scale.detach().to(torch.float32)
    return torch.tensor(_scalar(fn, "scale", scale, "> 0"), dtype=torch.float32)


def _multiply(tree: Any, factor: torch.Tensor) -> Any:
    """Multiplies floating tensors by the scale in at least fp32: a 2**16 scale does
    not fit in fp16, so an fp16 loss is upcast first (as torch.amp.GradScaler does)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        dtype = torch.promote_types(t.dtype, torch.float32)
        return t.to(dtype) * factor.to(device=t.device, dtype=dtype)

    return _tree.map_tensors(one, tree)


class StaticLossScale:
    """A fixed loss scale.

    Args:
      scale: a finite float > 0, or a 0-d float tensor.

    Raises:
      TypeError, ValueError: ``scale`` is not a finite positive float or 0-d tensor.
    """

    __slots__ = ("loss_scale",)
    loss_scale: torch.Tensor  # 0-d float32

    def __init__(self, scale: float | torch.Tensor) -> None:
        object.__setattr__(self, "loss_scale", _scale_tensor("StaticLossScale", scale))

    @classmethod
    def _make(cls, loss_scale: Any) -> StaticLossScale:
        new = object.__new__(cls)
        object.__setattr__(new, "loss_scale", loss_scale)
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StaticLossScale is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unflatten_static, (None, (self.loss_scale,)))

    def __repr__(self) -> str:
        return f"StaticLossScale(loss_scale={self.loss_scale!r})"

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating tensor of ``tree`` (a loss, usually) by the scale,
        in fp32 (or the tensor's dtype if wider)."""
        return _multiply(tree, self.loss_scale)

    def adjust(self, finite: torch.Tensor) -> StaticLossScale:
        """A static scale never changes."""
        return self

    def to(self, device: torch.device | str) -> StaticLossScale:
        """The same scale, held on ``device``."""
        return StaticLossScale._make(self.loss_scale.to(device))


class DynamicLossScale:
    """A loss scale that backs off on overflow and grows after a run of finite steps,
    as ``torch.amp.GradScaler`` does, decided on the device.

    After a step with non-finite grads: ``scale = max(scale * backoff_factor,
    min_scale)`` and the counter restarts. After ``growth_interval`` finite steps in a
    row: ``scale *= growth_factor`` (unless that overflows) and the counter restarts.

    Args:
      init_scale: the first scale, a finite float > 0.
      growth_interval: finite steps in a row before the scale grows (int >= 1).
      growth_factor: > 1.
      backoff_factor: in (0, 1).
      min_scale: the scale never backs off below this (>= 0).
      device: where the scale lives (default CPU; it moves to the grads' device at the
        first ``adjust``).

    Raises:
      TypeError, ValueError: a setting is out of range.
    """

    __slots__ = (
        "backoff_factor",
        "counter",
        "growth_factor",
        "growth_interval",
        "loss_scale",
        "min_scale",
    )
    loss_scale: torch.Tensor  # 0-d float32: the current scale
    counter: torch.Tensor  # 0-d int32: finite steps since the scale last changed
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        fn = "DynamicLossScale"
        scale = _scale_tensor(fn, init_scale)
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"{fn}: growth_interval: expected an int >= 1, got {growth_interval!r}")
        if growth_interval < 1:
            raise ValueError(f"{fn}: growth_interval: expected an int >= 1, got {growth_interval}")
        growth = _scalar(fn, "growth_factor", growth_factor, "> 1")
        backoff = _scalar(fn, "backoff_factor", backoff_factor, "in (0, 1)")
        floor = _scalar(fn, "min_scale", min_scale, ">= 0")
        self._set(
            scale.to(device) if device is not None else scale,
            torch.zeros((), dtype=torch.int32, device=device),
            growth_interval,
            growth,
            backoff,
            floor,
        )

    def _set(
        self,
        loss_scale: torch.Tensor,
        counter: torch.Tensor,
        growth_interval: int,
        growth_factor: float,
        backoff_factor: float,
        min_scale: float,
    ) -> None:
        for name, value in (
            ("loss_scale", loss_scale),
            ("counter", counter),
            ("growth_interval", growth_interval),
            ("growth_factor", growth_factor),
            ("backoff_factor", backoff_factor),
            ("min_scale", min_scale),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def _make(
        cls, loss_scale: torch.Tensor, counter: torch.Tensor, settings: tuple[Any, ...]
    ) -> DynamicLossScale:
        new = object.__new__(cls)
        new._set(loss_scale, counter, *settings)
        return new

    def settings(self) -> tuple[int, float, float, float]:
        """(growth_interval, growth_factor, backoff_factor, min_scale)."""
        return (self.growth_interval, self.growth_factor, self.backoff_factor, self.min_scale)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("DynamicLossScale is immutable; adjust() returns a new one")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unflatten_dynamic, (self.settings(), (self.loss_scale, self.counter)))

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(loss_scale={self.loss_scale!r}, counter={self.counter!r}, "
            f"growth_interval={self.growth_interval}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, min_scale={self.min_scale})"
        )

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating tensor of ``tree`` (a loss, usually) by the scale,
        in fp32 (or the tensor's dtype if wider)."""
        return _multiply(tree, self.loss_scale)

    def adjust(self, finite: torch.Tensor) -> DynamicLossScale:
        """The next state, given this step's 0-d bool ``finite`` flag (from ``all_finite``).

        Raises:
          TypeError: ``finite`` is not a 0-d bool tensor.
        """
        if not isinstance(finite, torch.Tensor) or finite.ndim != 0 or finite.dtype != torch.bool:
            raise TypeError(
                f"DynamicLossScale.adjust: finite: expected a 0-d bool tensor, got "
                f"{_checks.describe(finite)}"
            )
        device = finite.device
        scale = self.loss_scale.to(device)
        counter = self.counter.to(device)
        grown_count = counter + 1
        grow = grown_count >= self.growth_interval
        grown = scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, scale)  # never grow into inf
        backed = torch.clamp(scale * self.backoff_factor, min=self.min_scale)
        new_scale = torch.where(finite, torch.where(grow, grown, scale), backed)
        zero = torch.zeros_like(counter)
        new_counter = torch.where(finite & ~grow, grown_count, zero)
        return DynamicLossScale._make(new_scale, new_counter, self.settings())

    def to(self, device: torch.device | str) -> DynamicLossScale:
        """The same state, held on ``device``."""
        return DynamicLossScale._make(
            self.loss_scale.to(device), self.counter.to(device), self.settings()
        )


LossScale = Union[StaticLossScale, DynamicLossScale]
ScaleArg = Union[StaticLossScale, DynamicLossScale, float, torch.Tensor, None]


def scale_value(fn: str, scale: object) -> torch.Tensor | None:
    """The divisor for ``grads_to_fp32(..., scale=...)``: a loss-scale state, a float
    or a 0-d tensor; ``None`` for no scaling."""
    if scale is None:
        return None
    if isinstance(scale, (StaticLossScale, DynamicLossScale)):
        return scale.loss_scale
    return _scale_tensor(fn, scale)


def _flatten_static(s: Any) -> tuple[tuple[Any, ...], None, tuple[str, ...]]:
    return (s.loss_scale,), None, ("loss_scale",)


def _unflatten_static(_: Any, children: Any) -> Any:
    (loss_scale,) = children
    return StaticLossScale._make(loss_scale)


def _flatten_dynamic(s: Any) -> tuple[tuple[Any, ...], Any, tuple[str, ...]]:
    return (s.loss_scale, s.counter), s.settings(), ("loss_scale", "counter")


def _unflatten_dynamic(settings: Any, children: Any) -> Any:
    loss_scale, counter = children
    return DynamicLossScale._make(loss_scale, counter, settings)


_register: Any = optree.register_pytree_node
_register(StaticLossScale, _flatten_static, _unflatten_static, namespace=_tree.NAMESPACE)
_register(DynamicLossScale, _flatten_dynamic, _unflatten_dynamic, namespace=_tree.NAMESPACE)
