"""mpfunc's native CPU kernel: the whole mixed-precision Adam/AdamW step in one pass.

``adam_mixed_`` reads each low-precision grad, fp32 master and moment once and writes
the master, the moments and the rounded low-precision param once: 28 bytes per element
for bf16 grads and params, where ``grads_to_fp32_`` + fused AdamW + ``masters_to_model_``
move 40. Its results are bit-identical to that three-call path (torch's fused CPU
kernel on fp32 grads, then ``Tensor.to``) for non-NaN values, tested against torch 2.9's
AVX512, AVX2 and DEFAULT kernels; NaN lands in the same places, with payload bits not
promised. ``csrc/adam_mixed.cpp`` says which operation order it reproduces and why.

The C++ source is compiled on first use with ``torch.utils.cpp_extension.load`` (a C++
compiler and ninja; about 30 s to 3 min, most of it torch's headers) and cached in
torch's extension directory (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/<python>_<cpu|cuXYZ>/mpfunc_native_<hash>/``), the hash
covering the source, the torch version and the compiler flags: a new torch, source or
CPU capability builds once more, and concurrent first builds wait on torch's lock.
Where it cannot be built or loaded, ``load`` raises ``NativeUnavailable`` (an
``ImportError``) with the reason, once per process, and callers fall back to the
three-call path. ``MPFUNC_NATIVE=0`` in the environment turns it off.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

import torch

__all__ = [
    "NativeBuildError",
    "NativeUnavailable",
    "adam_mixed_",
    "available",
    "build_info",
    "load",
]

_SOURCE = Path(__file__).with_name("csrc") / "adam_mixed.cpp"
_ENV_SWITCH = "MPFUNC_NATIVE"


class NativeUnavailable(ImportError):
    """The native kernel cannot be built or loaded here; use the three-call path."""


class NativeBuildError(NativeUnavailable):
    """A compiler and ninja are present, but building or importing the kernel failed.

    Unlike a missing toolchain, this is a defect (in the source, the flags, or the
    toolchain): tests fail on it rather than skip.
    """


_lock = threading.Lock()
_module: Optional[ModuleType] = None
_error: Optional[NativeUnavailable] = None
_info: dict[str, Any] = {}


def _isa_flags() -> list[str]:
    """Instruction-set flags for the vector kernels torch itself dispatches to here.

    The kernel is written with ATen's ``Vectorized`` types, which pick their instruction
    set from ``CPU_CAPABILITY_*`` macros; we choose the one torch reports, so the loads,
    stores and float <-> bfloat16/float16 conversions are torch's own code. Explicit flags
    rather than ``-march=native``: the cached library is keyed on them, so a cache shared
    by machines of one capability never runs an instruction one of them lacks.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and capability.startswith("AVX512"):
        return [
            "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
            "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
        ]  # fmt: skip
    if x86 and capability == "AVX2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]


def _cflags() -> list[str]:
    # -ffp-contract=off: every fused multiply-add in the kernel is written out (fmadd,
    # std::fma), the exact ones torch's build makes; the compiler must add no others.
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", *_isa_flags()]


def _build_name(cflags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), " ".join(cflags).encode()):
        h.update(part)
        h.update(b"\0")
    return f"mpfunc_native_{h.hexdigest()[:16]}"


def _why_not() -> Optional[str]:
    """Why the kernel cannot be built here, checked without running a compiler."""
    if os.environ.get(_ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"disabled by {_ENV_SWITCH}={os.environ[_ENV_SWITCH]}"
    if sys.platform == "win32":
        return "the native kernel is built with GCC/Clang flags; Windows is not supported"
    if sys.platform == "darwin":
        # torch's headers include <omp.h> (its macOS wheels use OpenMP); Apple clang has
        # no OpenMP. Not attempted rather than failed.
        return "macOS is not supported (Apple clang has no OpenMP)"
    if not _SOURCE.is_file():
        return f"its source {_SOURCE} is missing from this installation"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX)"
    if not _ninja_on_path():
        return "ninja is not available (pip install ninja)"
    return None


def _ninja_dirs() -> list[str]:
    """Where a pip-installed ninja lives when its environment's bin is not on PATH."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        bin_dir = getattr(importlib.import_module("ninja"), "BIN_DIR", None)
    except ImportError:
        bin_dir = None
    if isinstance(bin_dir, str):
        dirs.insert(0, bin_dir)
    return dirs


def _ninja_on_path() -> bool:
    """Whether ``ninja`` runs by name, as torch's build calls it; puts a pip-installed
    ninja on this process's PATH when the virtual environment is not activated."""
    if shutil.which("ninja"):
        return True
    for d in _ninja_dirs():
        if shutil.which("ninja", path=d):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return True
    return False


def load() -> ModuleType:
    """Builds (first time only) and imports the native module, once per process.

    Returns:
      The extension module, with ``adam_mixed_``.

    Raises:
      NativeUnavailable: no compiler or ninja, the platform is not supported, or
        ``MPFUNC_NATIVE=0``; ``NativeBuildError`` (a subclass) when the toolchain is
        there but the build or import failed. The reason is in the message; the same
        error is raised again on every later call without retrying the build.
    """
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        reason = _why_not()
        if reason is not None:
            _error = NativeUnavailable(f"mpfunc native kernel unavailable: {reason}")
            raise _error
        from torch.utils import cpp_extension

        cflags = _cflags()
        name = _build_name(cflags)
        start = time.perf_counter()
        try:
            module = cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError, ValueError) as e:
            _error = NativeBuildError(f"mpfunc native kernel unavailable: build failed: {e}")
            raise _error from e
        if not isinstance(module, ModuleType):
            _error = NativeBuildError(f"mpfunc native kernel unavailable: loaded {module!r}")
            raise _error
        _info.update(
            name=name,
            path=getattr(module, "__file__", None),
            cflags=cflags,
            load_s=time.perf_counter() - start,
        )
        _module = module
        return module


def available() -> bool:
    """Whether ``load`` succeeds here (building the kernel on the first call)."""
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def build_info() -> dict[str, Any]:
    """Where the loaded module lives, its flags, and how long the first ``load`` took."""
    return dict(_info)


def adam_mixed_(
    masters: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
    max_exp_avg_sq: Optional[Sequence[torch.Tensor]],
    steps: Sequence[torch.Tensor],
    params_out: Optional[Sequence[torch.Tensor]],
    *,
    lr: Union[float, torch.Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW step over lists of CPU tensors, in place.

    Per leaf ``i``, in one pass over its elements::

      g = float32(grads[i]) / grad_scale       # if grad_scale; then negated if maximize
      steps[i] += 1
      masters[i], exp_avg[i], exp_avg_sq[i] (, max_exp_avg_sq[i]) <- torch's fused step
      params_out[i] = masters[i].to(params_out[i].dtype)   # if params_out

    The result equals ``torch._fused_adam_``/``torch._fused_adamw_`` on ``g`` with the
    incremented steps (bit for bit for finite values on x86 torch 2.9), then
    ``params_out[i].copy_(masters[i])``.

    Args:
      masters, exp_avg, exp_avg_sq: float32 CPU tensors, updated in place.
      grads: float32, bfloat16 or float16 CPU tensors (one dtype for all), read only.
      max_exp_avg_sq: float32 tensors with ``amsgrad``, else ``None`` or empty.
      steps: one-element float32 CPU tensors, incremented in place.
      params_out: bfloat16, float16 or float32 tensors (one dtype for all) that receive
        the rounded masters, or ``None``.
      lr: a float or a one-element CPU tensor (read at the call).
      beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize: as in
        ``torch.optim.Adam``/``AdamW``; ``decoupled`` selects AdamW's weight decay.
      grad_scale: a one-element float CPU tensor the grads are divided by, or ``None``.
      found_inf: a one-element float CPU tensor; when it is nonzero nothing is written,
        step counts included.

    Every tensor of a leaf must have the master's shape. Leaves whose tensors are all
    dense with the master's strides (contiguous, or permuted alike) are updated in
    place in memory order; any other layout is updated through contiguous copies,
    pairing elements by logical index, and written back.

    Raises:
      NativeUnavailable: the kernel cannot be built here.
      TypeError, ValueError: a list's length, a dtype, device, shape or layout is wrong,
        or a written tensor overlaps itself. Raised before anything is written.
    """
    module = load()
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    module.adam_mixed_(
        masters, grads, exp_avg, exp_avg_sq, max_exp_avg_sq or [], steps, params_out or [],
        0.0 if lr_tensor is not None else float(lr), lr_tensor, float(beta1), float(beta2),
        float(eps), float(weight_decay), bool(decoupled), bool(amsgrad), bool(maximize),
        grad_scale, found_inf,
    )  # fmt: skip
