"""``ConsumedGrad``: what a param's ``.grad`` holds once the step inside backward used it.

A leaf stepped inside backward has no grad left to read: its update is done and its grad's
memory freed. Leaving ``.grad`` as ``None`` made every whole-tree habit after the backward
silently do nothing: ``torch.nn.utils.clip_grad_norm_`` (which HF's Trainer calls by
default) found no grads and clipped nothing, a grad-norm logger read 0. So the hook leaves
a ``ConsumedGrad`` there instead: a tensor of the grad's shape, dtype and device with no
memory at all (a wrapper subclass, ``_make_wrapper_subclass``), on which every operation
that would read or write values raises an error that names the param and says why. The
step's end (``opt.step()``, ``handle.end_step()``) sets ``.grad`` back to ``None``.

Let through, because they read no values: ``detach`` (clip functions detach first),
``zero_`` and ``_foreach_zero_`` (``zero_grad(set_to_none=False)``: nothing to zero),
``_to_copy`` (``model.to(...)`` converts each ``.grad``: a marker of the new dtype and
device). ``copy.deepcopy`` of a tensor gives its copy no grad. Metadata (shape, dtype,
device, strides) reads as the grad's; ``nbytes`` is ``numel * itemsize`` as for every
tensor, though nothing is held. The DLPack, NumPy and CUDA array interfaces raise (they
bypass ``__torch_dispatch__``); ``torch.utils.dlpack.to_dlpack`` called on one directly cannot be
intercepted.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

__all__ = ["NESTED_AFTER", "SECOND_BACKWARD", "WHOLE_TREE", "ConsumedGrad", "in_nested_backward"]

WHOLE_TREE = (
    "each leaf steps inside backward as soon as its own grad is complete, before the other "
    "grads exist"
)

_READ = (
    "{where}: {leaf}: its grad was used and freed by the step inside backward "
    "(step_in_backward): the leaf stepped as soon as that grad was complete, so the grad "
    "cannot be read ({op}) before the step ends ({end}). {why}. This step's updates are "
    "already applied: call {end} to end it before the next backward"
)
_CLIP = (
    "A global-norm clip (torch.nn.utils.clip_grad_norm_, which HF's Trainer calls when "
    "max_grad_norm > 0), a value clip or a grad norm needs every grad before any leaf "
    "steps, but " + WHOLE_TREE + ". Clip without step_in_backward (the ordinary step), or "
    "train without the clip (max_grad_norm=0 in HF's TrainingArguments)"
)
_SCALER = (
    "torch.amp.GradScaler unscales the grads before the step, and its inf check spans every "
    "grad, but " + WHOLE_TREE + ": the leaves already stepped with the scaled grads. Drop "
    "the GradScaler (train bf16 without one) or build the optimizer without step_in_backward"
)
SECOND_BACKWARD = (
    "{where}: {leaf} received a second grad before the step ended ({end}): it has already "
    "stepped (and its grad was freed) in this step's backward. Call {end} after every "
    "backward, also after an error between the backward and {end} (a refused clip): that "
    "step's updates are already applied. Gradient accumulation across micro-batches and a "
    "second backward (retain_graph=True) cannot work with the step inside backward, "
    "because " + WHOLE_TREE + "; accumulate without step_in_backward"
)
# The Python entries of a backward: a nested one (reentrant checkpointing's segments) is a
# second such frame on the stack of a hook or of autograd's accumulation.
_BACKWARD_CODES = frozenset({torch.autograd.backward.__code__, torch.autograd.grad.__code__})

NESTED_AFTER = (
    "{where}: {leaf} received more grad from a reentrant checkpointed segment "
    "(torch.utils.checkpoint(..., use_reentrant=True)) after it had stepped on the grad of "
    "its uses outside the segment: that step used a partial grad. Use use_reentrant=False "
    "(or build the optimizer without step_in_backward); call {end} to end this step"
)


def in_nested_backward() -> bool:
    """Whether the caller runs inside a backward nested in another backward."""
    frame: types.FrameType | None = sys._getframe(1)
    seen = 0
    while frame is not None:
        if frame.f_code in _BACKWARD_CODES:
            seen += 1
            if seen == 2:
                return True
        frame = frame.f_back
    return False


# Operations that read no values (see the module docstring).
_ALLOWED_NO_OP = ("aten::zero_", "aten::_foreach_zero_")


class ConsumedGrad(torch.Tensor):
    """The ``.grad`` of a param whose leaf stepped inside backward, until the step ends.

    Holds no memory. Its shape, dtype and device are the grad's; reading its values (a
    norm, a clip, a copy) raises a ``RuntimeError`` naming the param, as does adding a
    second grad to it (a second backward before ``opt.step()``). Test for it with
    ``isinstance(p.grad, mpfunc.ConsumedGrad)``.
    """

    _where: str
    _leaf: str
    _end: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, where: str, leaf: str, end: str) -> ConsumedGrad:
        return cls._make(like.shape, like.stride(), like.dtype, like.device, where, leaf, end)

    @classmethod
    def _make(
        cls,
        shape: torch.Size,
        strides: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        where: str,
        leaf: str,
        end: str,
    ) -> ConsumedGrad:
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=dtype, device=device, requires_grad=False
        )
        out._where, out._leaf, out._end = where, leaf, end
        return out

    def __init__(self, like: torch.Tensor, where: str, leaf: str, end: str) -> None:
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def _names(self) -> tuple[str, str, str]:
        return self._where, self._leaf, self._end

    @property
    def leaf(self) -> str:
        """The param's path (``params.0``, or its name in the optimizer)."""
        return self._leaf

    @property
    def end(self) -> str:
        """The call that ends the step (``opt.step()``, ``handle.end_step()``)."""
        return self._end

    def message(self, op: str = "") -> str:
        """The error for a read of this grad's values by the operator ``op``."""
        why = _SCALER if "_amp_" in op else _CLIP
        return _READ.format(
            where=self._where, leaf=self._leaf, op=op or "its values", end=self._end, why=why
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = func._schema.name
        marker = _first_marker(args)
        if name == "aten::detach":
            return cls(marker, *marker._names())
        if name == "aten::_to_copy":  # model.to(dtype or device): the grad converted too
            kw = kwargs or {}
            dtype = kw.get("dtype") or marker.dtype
            device = kw.get("device") or marker.device
            return cls._make(marker.shape, marker.stride(), dtype, device, *marker._names())
        if name in _ALLOWED_NO_OP:
            # zero_grad(set_to_none=False): zero the real grads beside the markers.
            if name == "aten::zero_":
                return args[0]
            rest = [t for t in args[0] if not isinstance(t, ConsumedGrad)]
            if rest:
                torch._foreach_zero_(rest)
            return None
        if torch._C._current_graph_task_id() != -1 and name.startswith("aten::add"):
            # autograd adding a new grad to this one: a second backward in the same step, or
            # a reentrant checkpointed segment's nested backward after the leaf stepped
            why = NESTED_AFTER if in_nested_backward() else SECOND_BACKWARD
            raise RuntimeError(why.format(where=marker._where, leaf=marker._leaf, end=marker._end))
        raise RuntimeError(marker.message(name))

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ConsumedGrad({self._leaf}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: used and freed by the step inside backward)"
        )

    def __reduce_ex__(self, proto: Any) -> Any:
        raise RuntimeError(self.message("pickle"))

    def __deepcopy__(self, memo: Any) -> None:
        # ``copy.deepcopy`` of a tensor copies its ``.grad`` this way: the copy has none.
        return None

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self.message("__array__"))

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self.message("__dlpack__"))

    def tolist(self) -> Any:  # torch refuses it for every subclass, without the param's name
        raise RuntimeError(self.message("tolist"))

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self.message("numpy"))

    def __dlpack_device__(self) -> Any:
        raise RuntimeError(self.message("__dlpack_device__"))

    @property
    def __cuda_array_interface__(self) -> Any:
        raise RuntimeError(self.message("__cuda_array_interface__"))


def _first_marker(args: Any) -> ConsumedGrad:
    for a in args:
        if isinstance(a, ConsumedGrad):
            return a
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, ConsumedGrad):
                    return t
    raise AssertionError("no ConsumedGrad among the arguments")  # pragma: no cover
