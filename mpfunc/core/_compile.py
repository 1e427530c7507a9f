"""Whether mpfunc's code is being traced by ``torch.compile`` (dynamo).

Under dynamo, host Python runs once per guard set while tracing and leaves only its
tensor ops in the graph. The few places that would stop a trace (optree's C++ flatten,
memory addresses, torch's fused optimizer kernels, pausing the garbage collector) ask
``compiling()`` and take a traceable twin; eager code never sees a difference.
"""

from __future__ import annotations

import torch

__all__ = ["compiling", "func_transform_active"]


def compiling() -> bool:
    """True while dynamo traces the caller (a constant in the traced code), else False."""
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def func_transform_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, vmap...) is running."""
    functorch = getattr(torch._C, "_functorch", None)
    level = getattr(functorch, "maybe_current_level", None)
    return level is not None and level() is not None
