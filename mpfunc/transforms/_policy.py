"""``Policy``: which dtype params, computation and outputs use, cast over trees."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mpfunc.core import _tree
from mpfunc.transforms._loss_scale import DynamicLossScale, StaticLossScale

__all__ = ["Policy"]

_DTYPES: dict[str, torch.dtype] = {
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
_FIELDS: dict[str, str] = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
}
_CANONICAL = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


# Nodes a cast passes through whole: a loss scale's fp32 scale is state, not data (in bf16
# it would round; 2**16 in fp16 is inf).
_KEPT = (StaticLossScale, DynamicLossScale)


def _name(dtype: torch.dtype) -> str:
    return _CANONICAL.get(dtype) or str(dtype).removeprefix("torch.")


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    """Casts floating tensors to ``dtype``; everything else (loss scales included) passes
    through as is."""
    return _tree.map_tensors(
        lambda t: t.to(dtype) if t.is_floating_point() else t, tree, kept=_KEPT
    )


def _float8_names() -> list[str]:
    """The float8 dtype names this torch has (``Policy.parse`` takes them too)."""
    return sorted(
        n
        for n in dir(torch)
        if n.startswith("float8") and isinstance(getattr(torch, n), torch.dtype)
    )


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of params, of computation, and of outputs.

    Casts touch only floating-point tensors; int and bool tensors, ``None``, non-tensor
    leaves and loss scales (``StaticLossScale``, ``DynamicLossScale``: their fp32 scale is
    state, not data) pass through unchanged.

    Example::

      policy = mpfunc.Policy.parse("params=float32,compute=bfloat16,output=float32")
      x = policy.cast_to_compute(batch)
      logits = policy.cast_to_output(model(x))
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, field)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise TypeError(f"Policy: {field}: expected a floating torch.dtype, got {value!r}")

    @classmethod
    def parse(cls, spec: str) -> Policy:
        """Builds a policy from ``"params=float32,compute=bfloat16,output=float32"``.

        Keys: params (p), compute (c), output (o); omitted keys are float32. Dtype
        names: float32/fp32/f32/float, bfloat16/bf16, float16/fp16/f16/half,
        float64/fp64/f64/double, and torch's float8 names (float8_e4m3fn, ...).

        Raises:
          ValueError: an unknown key or dtype name (the message lists the valid
            ones), a key given twice, or an entry without ``=``.
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.parse: expected a str, got {type(spec).__name__}")
        values: dict[str, torch.dtype] = {}
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            key, eq, name = (part.strip() for part in entry.partition("="))
            if not eq:
                raise ValueError(f"Policy.parse: expected key=dtype, got {entry!r}")
            field = _FIELDS.get(key.lower())
            if field is None:
                raise ValueError(
                    f"Policy.parse: unknown key {key!r}; expected one of {', '.join(_FIELDS)}"
                )
            dtype = _DTYPES.get(name.lower())
            if dtype is None and name.lower().startswith("float8"):
                found = getattr(torch, name.lower(), None)
                dtype = found if isinstance(found, torch.dtype) else None
            if dtype is None:
                raise ValueError(
                    f"Policy.parse: unknown dtype {name!r} for {key}; expected one of "
                    f"{', '.join([*_DTYPES, *_float8_names()])}"
                )
            if field in values:
                raise ValueError(f"Policy.parse: {key!r} is given twice in {spec!r}")
            values[field] = dtype
        return cls(**values)

    def __str__(self) -> str:
        return (
            f"params={_name(self.param_dtype)},compute={_name(self.compute_dtype)},"
            f"output={_name(self.output_dtype)}"
        )

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating tensors of ``tree`` to ``param_dtype``."""
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating tensors of ``tree`` to ``compute_dtype``."""
        return _cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating tensors of ``tree`` to ``output_dtype``."""
        return _cast(tree, self.output_dtype)
