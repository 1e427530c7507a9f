"""Whether mpfunc's code is being traced by ``torch.compile`` (dynamo).

Under dynamo, host Python runs once per guard set while tracing and leaves only its
tensor ops in the graph. The few places that would stop a trace (optree's C++ flatten,
memory addresses, torch's fused optimizer kernels, pausing the garbage collector) ask
``compiling()`` and take a traceable twin; eager code never sees a difference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["compiling", "func_transform_active"]

# True while dynamo traces the caller (a constant in the traced code), else False. torch's
# own function (torch >= 2.3), not a wrapper: it is asked a few times per call per module.
compiling: Callable[[], bool] = torch.compiler.is_compiling


def func_transform_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, vmap...) is running."""
    functorch = getattr(torch._C, "_functorch", None)
    level = getattr(functorch, "maybe_current_level", None)
    return level is not None and level() is not None
