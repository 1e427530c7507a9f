"""Loss scaling as pytree state: ``StaticLossScale`` and ``DynamicLossScale``.

As in jmp, a loss scale is an immutable value (a frozen dataclass). ``scale(loss)``
multiplies, ``grads_to_fp32(grads, scale=...)`` divides while upcasting, and
``adjust(finite)`` returns the next state. Every decision (back off, grow) is a
``torch.where`` on the device, so a step never waits on the host.

Both classes are nodes of mpfunc's trees: their tensors (``loss_scale``, ``counter``)
are the children and their settings the metadata, so flatten/unflatten and
``state_dict``/``save``/``load`` keep every field. ``torch.load(weights_only=True)``
reads them back too (they are on its allowlist once mpfunc is imported).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, Union

import torch

from mpfunc.core import _checks, _tree

__all__ = ["DynamicLossScale", "ScaleArg", "StaticLossScale", "scale_value"]

_F32 = torch.finfo(torch.float32)
# The counter is int32, as GradScaler's growth tracker: it saturates here instead of wrapping.
_COUNT_MAX = 2**31 - 1


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _scale_float(fn: str, name: str, value: object) -> float:
    """A scale: > 0, and a normal float32 number, because the device holds it in float32
    (1e39 would be inf there, and XLA/TPU flush subnormals to 0)."""
    v = _checks.real(fn, name, value, gt=0)
    _checks.real(fn, f"{name} ({v!r} in float32)", _float32(v), ge=_F32.tiny)
    return v


def _factor(fn: str, name: str, value: object, *, gt: float, lt: float | None = None) -> float:
    """A factor within the bounds, as given and as float32 (1 + 1e-9 is 1 in float32: a
    growth that never grows, a backoff that never backs off)."""
    v = _checks.real(fn, name, value, gt=gt, lt=lt)
    _checks.real(fn, f"{name} ({v!r} in float32)", _float32(v), gt=gt, lt=lt)
    return v


def _read_scale(fn: str, name: str, value: object) -> tuple[float, torch.device]:
    """A constructor's scale, a float or a 0-d float tensor (read once, here), and its device."""
    if isinstance(value, torch.Tensor):
        _check_scale_tensor(fn, name, value)
        return _scale_float(fn, name, float(value)), value.device
    return _scale_float(fn, name, value), torch.device("cpu")


def _check_scale_tensor(fn: str, name: str, value: torch.Tensor) -> None:
    if value.ndim != 0 or not value.is_floating_point():
        raise TypeError(
            f"{fn}: {name}: expected a finite float > 0 or a 0-d float tensor, got "
            f"{_checks.describe(value)}"
        )


def _check_finite(fn: str, finite: object) -> torch.Tensor:
    if not isinstance(finite, torch.Tensor) or finite.ndim != 0 or finite.dtype != torch.bool:
        raise TypeError(f"{fn}: finite: expected a 0-d bool tensor, got {_checks.describe(finite)}")
    return finite


def _multiply(tree: Any, factor: torch.Tensor) -> Any:
    """Multiplies floating tensors by the scale in at least fp32: a 2**16 scale does
    not fit in fp16, so an fp16 loss is upcast first (as torch.amp.GradScaler does)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        dtype = torch.promote_types(t.dtype, torch.float32)
        return t.to(dtype) * factor.to(device=t.device, dtype=dtype)

    return _tree.map_tensors(one, tree)


_S = TypeVar("_S")


def _replace(state: _S, /, **fields: Any) -> _S:
    """A copy of the frozen ``state`` with ``fields`` changed, set as pickle and unflatten
    set them (``dataclasses.replace`` would call ``__init__``, which takes GradScaler's
    arguments, not the fields)."""
    new = object.__new__(type(state))
    # Field by field through object.__setattr__ (the class is frozen): dynamo traces this
    # under torch.compile, and not an update of ``__dict__``.
    for f in dataclasses.fields(state):  # type: ignore[arg-type]
        object.__setattr__(new, f.name, fields.get(f.name, getattr(state, f.name)))
    return new


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale:
    """A fixed loss scale.

    Args:
      scale: a finite float > 0 (a normal float32 number), or a 0-d float tensor (its
        value is read once, to check it).

    Raises:
      TypeError, ValueError: ``scale`` is not one of those.
    """

    loss_scale: torch.Tensor  # 0-d float32

    def __init__(self, scale: float | torch.Tensor) -> None:
        value, device = _read_scale("StaticLossScale", "scale", scale)
        # frozen: the field is set once, as pickle and unflatten set it
        self.__dict__["loss_scale"] = torch.tensor(value, dtype=torch.float32, device=device)

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating tensor of ``tree`` (a loss, usually) by the scale,
        in fp32 (or the tensor's dtype if wider)."""
        return _multiply(tree, self.loss_scale)

    def adjust(self, finite: torch.Tensor) -> StaticLossScale:
        """A static scale never changes: returns ``self``."""
        _check_finite("StaticLossScale.adjust", finite)
        return self

    def to(self, device: torch.device | str) -> StaticLossScale:
        """The same scale, held on ``device``."""
        return _replace(self, loss_scale=self.loss_scale.to(device))


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale:
    """A loss scale that backs off on overflow and grows after a run of finite steps,
    as ``torch.amp.GradScaler`` does, decided on the device.

    After a step with non-finite grads: ``scale = max(scale * backoff_factor,
    min_scale)`` and the counter restarts. After ``growth_interval`` finite steps in a
    row: ``scale *= growth_factor`` (unless that overflows) and the counter restarts.
    The scale stays within [min_scale, float32 max] and never reaches 0.

    Args:
      init_scale: the first scale, a finite float > 0 (a normal float32 number), or a
        0-d float tensor (read once, to check it).
      growth_interval: finite steps in a row before the scale grows, an int >= 1. The
        counter is int32, as GradScaler's, so 2**31 or more means "never grow".
      growth_factor: > 1 (also in float32).
      backoff_factor: in (0, 1) (also in float32).
      min_scale: the scale never backs off below this; in [0, init_scale]. Below
        float32's smallest normal number (1.2e-38, 0 included) the floor is that number.
      device: where the state lives (default: CPU, or ``init_scale``'s device if it is a
        tensor; it moves to the flag's device at the first ``adjust``).

    Raises:
      TypeError, ValueError: a setting is out of range.
    """

    loss_scale: torch.Tensor  # 0-d float32: the current scale
    counter: torch.Tensor  # 0-d int32: finite steps in a row since the scale last changed
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float

    def __init__(
        self,
        init_scale: float | torch.Tensor = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        fn = "DynamicLossScale"
        scale, where = _read_scale(fn, "init_scale", init_scale)
        interval = _checks.integer(fn, "growth_interval", growth_interval, ge=1)
        growth = _factor(fn, "growth_factor", growth_factor, gt=1)
        backoff = _factor(fn, "backoff_factor", backoff_factor, gt=0, lt=1)
        floor = _checks.real(fn, "min_scale", min_scale, ge=0)
        if floor > scale:
            raise ValueError(
                f"{fn}: min_scale: expected a float <= init_scale ({scale!r}), got {floor!r}"
            )
        where = torch.device(device) if device is not None else where
        self.__dict__.update(  # frozen: set once, as pickle and unflatten set them
            loss_scale=torch.tensor(scale, dtype=torch.float32, device=where),
            counter=torch.zeros((), dtype=torch.int32, device=where),
            growth_interval=interval,
            growth_factor=growth,
            backoff_factor=backoff,
            min_scale=floor,
        )

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating tensor of ``tree`` (a loss, usually) by the scale,
        in fp32 (or the tensor's dtype if wider)."""
        return _multiply(tree, self.loss_scale)

    def adjust(self, finite: torch.Tensor) -> DynamicLossScale:
        """The next state, given this step's 0-d bool ``finite`` flag (from ``all_finite``),
        on the flag's device, with no host read.

        Raises:
          TypeError: ``finite`` is not a 0-d bool tensor.
        """
        finite = _check_finite("DynamicLossScale.adjust", finite)
        scale = self.loss_scale.to(finite.device)
        counter = self.counter.to(finite.device)
        count = counter.clamp(max=_COUNT_MAX - 1) + 1  # never wraps
        if self.growth_interval <= _COUNT_MAX:
            grow = finite & (count >= self.growth_interval)
        else:  # an int32 count never gets there (GradScaler's never grows either); comparing
            # it with the Python int would wrap the int to int32 and grow on every step
            grow = torch.zeros_like(finite)
        grown = scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, scale)  # never grow into inf
        # The floor keeps the scale > 0: at 0, unscaling would divide 0 by 0.
        backed = torch.clamp(scale * self.backoff_factor, min=max(self.min_scale, _F32.tiny))
        new_scale = torch.where(finite, torch.where(grow, grown, scale), backed)
        new_counter = torch.where(finite & ~grow, count, torch.zeros_like(count))
        return _replace(self, loss_scale=new_scale, counter=new_counter)

    def to(self, device: torch.device | str) -> DynamicLossScale:
        """The same state, held on ``device``."""
        return _replace(
            self, loss_scale=self.loss_scale.to(device), counter=self.counter.to(device)
        )


_tree.register_dataclass(StaticLossScale, children=("loss_scale",), positive=("loss_scale",))
_tree.register_dataclass(
    DynamicLossScale, children=("loss_scale", "counter"), positive=("loss_scale",)
)
# Frozen dataclasses of tensors and numbers: safe for torch.load(weights_only=True).
torch.serialization.add_safe_globals([StaticLossScale, DynamicLossScale])

ScaleArg = Union[StaticLossScale, DynamicLossScale, float, torch.Tensor, None]


def scale_value(fn: str, scale: object) -> torch.Tensor | None:
    """The divisor for ``grads_to_fp32(..., scale=...)``: a loss-scale state, a float or a
    0-d float tensor (whose value is not checked: that would be a host read every step);
    ``None`` for no scaling."""
    if scale is None:
        return None
    if isinstance(scale, (StaticLossScale, DynamicLossScale)):
        return scale.loss_scale
    if isinstance(scale, torch.Tensor):
        _check_scale_tensor(fn, "scale", scale)
        return scale.detach().to(torch.float32)
    return torch.tensor(_scale_float(fn, "scale", scale), dtype=torch.float32)
