"""mpfunc's native CPU kernels: the mixed-precision Adam/AdamW step in one pass, and casts.

``adam_mixed_`` (behind the ``"native"`` kernel of ``adam``/``adamw``, written in
``optim/_adam.py``) reads each grad (fp32,
bf16 or fp16), fp32 master and moment once and writes the master, the moments and, when
the group has ``model`` tensors, the rounded low-precision param once: 28 bytes per
element for bf16 grads and params, where ``grads_to_fp32_`` + fused AdamW +
``masters_to_model_`` move 40. Its results are bit-identical to that three-call path
(torch's fused CPU kernel on the fp32 grads divided by ``scale``, then ``Tensor.to``) for
non-NaN values (tested against torch 2.9's AVX512, AVX2 and DEFAULT kernels, and 2.4's
AVX512); NaN
lands in the same places, with payload bits not promised.

The same kernel serves every master strategy and state format (``step_composed_``, picked
by ``_plan._composed_fits``): per tile of 1,024 elements the strategy's load and the state
format's decode fill cache-resident fp32 scratch, the fp32 math runs on it, and the encode
and store write it back, bit for bit the torch path (load, torch's fused kernel, store).

``rule_step`` (behind the ``"native"`` kernels of ``sgd`` and ``lion``, in their modules)
runs the same composed pieces around SGD's or Lion's math (``step_rule_``), bit for bit
the torch path with the foreach kernel. The optimizer modules hold their adapters and
call this module's entries (``adam_mixed_``, ``composed_args`` with ``load()``'s
``step_composed_``, ``rule_step``), and register how ``serves`` probes them
(``register_rule``): this layer never imports the optimizers.

``cast_`` converts lists of
tensors between float32 and bfloat16/float16 bit for bit as ``Tensor.to`` does, NaN
included (mpfunc uses it only for the dtype pairs where torch's own NaN bits do not
depend on its thread split; see ``cast_agrees``). ``csrc/adam_mixed.cpp`` says which
operation order it reproduces and why.

The C++ source is compiled on first use (``available()``) with
``torch.utils.cpp_extension`` (a C++ compiler and the system's ``ninja``; 30 s to 3 min,
most of it torch's headers) and cached in ``$TORCH_EXTENSIONS_DIR`` if set, else
``$MPFUNC_HOME/native`` (default ``~/.cache/mpfunc/native``), one folder per hash of the
source, the torch and Python versions, the compiler and its flags: a new torch, source or
CPU capability builds once more, a cached library that does not import (cut short by a
full disk or a killed link) is built again, and concurrent builds wait on torch's lock. Where
it cannot be built or loaded, mpfunc uses torch's kernels instead and warns once per
process (``NativeFallbackWarning``); ``MPFUNC_NATIVE=0`` turns it off without a warning.
``python -m mpfunc.backends._native`` builds it ahead of time and prints where and how long.

See docs/design.md#the-native-cpu-pass.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from mpfunc.core import _cache
from mpfunc.state_formats import _state_format
from mpfunc.strategies import _strategy

if TYPE_CHECKING:
    from mpfunc.core._optimizer import Group

__all__ = [
    "NativeBuildError",
    "NativeFallbackWarning",
    "NativeUnavailable",
    "adam_mixed_",
    "available",
    "build_info",
    "cast_",
    "cast_agrees",
    "casts",
    "composed_args",
    "key_function",
    "load",
    "loaded",
    "plain",
    "register_rule",
    "rule_step",
    "salts",
    "serves",
]

_SOURCE = Path(__file__).with_name("csrc") / "adam_mixed.cpp"
_ENV_SWITCH = "MPFUNC_NATIVE"
# Where ninja lives when a minimal PATH (cron, some CI runners) leaves it out.
_NINJA_DIRS = ("/usr/bin", "/usr/local/bin")

_log = logging.getLogger("mpfunc")


class NativeUnavailable(ImportError):
    """The native kernel cannot be built or loaded here; use the three-call path."""


class NativeBuildError(NativeUnavailable):
    """A compiler and ninja are present, but building or importing the kernel failed.

    Unlike a missing toolchain, this is a defect (in the source, the flags, or the
    toolchain): tests fail on it rather than skip.
    """


class NativeFallbackWarning(RuntimeWarning):
    """mpfunc's native CPU kernel is unavailable; torch's kernels run instead (slower)."""


_lock = threading.Lock()
_module: Optional[ModuleType] = None
_error: Optional[NativeUnavailable] = None
_warned = False
_info: dict[str, Any] = {}


def _isa_flags() -> list[str]:
    """Instruction-set flags for the vector kernels torch itself dispatches to here.

    The kernel is written with ATen's ``Vectorized`` types, which pick their instruction
    set from ``CPU_CAPABILITY_*`` macros; we choose the one torch reports, so the loads,
    stores and float <-> bfloat16/float16 conversions are torch's own code; on AVX-512 CPUs
    with AVX512_BF16, that instruction set too, for one bf16 rounding that gives torch's
    bits (``narrow2`` in the kernel). Explicit flags rather than ``-march=native``: the
    cached library is keyed on them, so a cache shared by machines of one capability never
    runs an instruction one of them lacks.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and capability.startswith("AVX512"):
        flags = [
            "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
            "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
        ]  # fmt: skip
        if _has_avx512_bf16():  # the kernel's one-instruction bf16 rounding (narrow2)
            flags += ["-mavx512bf16", "-DMPF_AVX512BF16"]
        return flags
    if x86 and capability == "AVX2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]


@functools.cache
def _has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) and
    the compiler takes ``-mavx512bf16`` (GCC 10, clang 9), so the kernel may use it."""
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # (torch >= 2.5)
    if check is not None:
        has = bool(check())
    else:
        try:
            with open("/proc/cpuinfo") as f:
                has = any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
        except OSError:
            has = False
    if not has:
        return False
    # Compiled and assembled, not only preprocessed: a compiler that takes the flag with an
    # assembler that lacks the instruction would otherwise fail the whole kernel's build.
    # The probe takes ~0.4 s, so its answer is kept in the cache folder, per compiler file.
    compiler = shutil.which(_compiler()) or _compiler()
    try:
        stamp = os.stat(compiler).st_mtime_ns
    except OSError:
        stamp = 0
    tag = hashlib.sha256(f"{compiler}\0{stamp}".encode()).hexdigest()[:16]
    marker = cache_dir() / f"avx512bf16_probe_{tag}"
    with contextlib.suppress(OSError):
        return marker.read_text() == "1"
    probe = [compiler, "-mavx512f", "-mavx512bf16", "-O0", "-c", "-x", "c++", "-"]
    try:
        done = subprocess.run(
            [*probe, "-o", os.devnull],
            input=_BF16_PROBE,
            capture_output=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    ok = done.returncode == 0
    with contextlib.suppress(OSError):
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("1" if ok else "0")
    return ok


_BF16_PROBE = b"""#include <immintrin.h>
__m512i f(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }
"""


def _cflags() -> list[str]:
    # -ffp-contract=off: every fused multiply-add in the kernel is written out (fmadd,
    # std::fma), the exact ones torch's build makes; the compiler must add no others.
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", *_isa_flags()]


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _build_name(cflags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        f"{sys.implementation.cache_tag} {platform.machine()}",
        shutil.which(_compiler()) or _compiler(),
        " ".join(cflags),
    ):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return f"mpfunc_native_{h.hexdigest()[:16]}"


def cache_dir() -> Path:
    """The folder holding one build folder per source/torch/flags hash."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    home = os.environ.get("MPFUNC_HOME") or os.path.join("~", ".cache", "mpfunc")
    return Path(home).expanduser() / "native"


def _disabled() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


def _find_ninja() -> Optional[str]:
    """The ninja that torch's build runs by name: on PATH, else the system's (then put on
    this process's PATH, which torch's build reads)."""
    found = shutil.which("ninja")
    if found:
        return found
    for d in _NINJA_DIRS:
        found = shutil.which("ninja", path=d)
        if found:
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return found
    return None


def _why_not() -> Optional[str]:
    """Why the kernel cannot be built here, checked without running a compiler."""
    if _disabled():
        return f"disabled by {_ENV_SWITCH}={os.environ[_ENV_SWITCH]}"
    if sys.platform == "win32":
        return "the native kernel is built with GCC/Clang flags; Windows is not supported"
    if sys.platform == "darwin":
        # torch's headers include <omp.h> (its macOS wheels use OpenMP); Apple clang has
        # no OpenMP. Not attempted rather than failed.
        return "macOS is not supported (Apple clang has no OpenMP)"
    if not _SOURCE.is_file():
        return f"its source {_SOURCE} is missing from this installation"
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()!r} is not on PATH; set CXX)"
    if _find_ninja() is None:
        return "ninja is not installed (e.g. apt-get install ninja-build)"
    return None


def _build(name: str, cflags: list[str]) -> ModuleType:
    from torch.utils import cpp_extension

    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = (build_dir / f"{name}.so").is_file()
    if not cached:
        _log.warning(
            "mpfunc: building the native CPU kernel in %s (once per torch version; "
            "30 s to 3 min)", build_dir,
        )  # fmt: skip
    start = time.perf_counter()
    if cached:
        # The folder's name is a hash of everything the build depends on, so a library
        # there is this build: import it directly, without torch's ninja freshness check
        # (seconds per process; every torchrun worker would pay it).
        library = build_dir / f"{name}.so"
        module = _import_built(name, library) if _whole(library) else None
        if module is not None:
            seconds = time.perf_counter() - start
            _info.update(name=name, path=module.__file__, cflags=cflags, cached=True,
                         load_s=seconds, build_s=None)  # fmt: skip
            return module
        # It does not import (cut short by a full disk or a killed link, overwritten):
        # torch's ninja check would find it up to date and import it again, failing in
        # every process. Build it again.
        _discard(build_dir, name)
        cached = False
    # torch's build warns about compilers it did not test (UserWarning); those are not
    # the caller's warnings, and under ``-W error`` they would abort a working build.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    for w in caught:
        _log.info("mpfunc: while building the native kernel: %s", w.message)
    seconds = time.perf_counter() - start
    if not isinstance(module, ModuleType):
        raise ImportError(f"loaded {module!r}, not a module")
    _info.update(
        name=name,
        path=getattr(module, "__file__", None),
        cflags=cflags,
        cached=cached,
        load_s=seconds,
        build_s=None if cached else seconds,
    )
    if not cached:
        _log.warning("mpfunc: built the native CPU kernel in %.0f s", seconds)
    return module


def _import_built(name: str, path: Path) -> Optional[ModuleType]:
    """Imports an already built extension, or returns None where it does not import
    (then ``_build`` builds it again)."""
    import importlib.machinery
    import importlib.util

    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        if spec is None:
            return None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as e:
        _log.warning("mpfunc: the cached native CPU kernel %s does not import (%s); "
                     "building it again", path, e)  # fmt: skip
        return None
    sys.modules[name] = module
    return module


def _whole(path: Path) -> bool:
    """Whether a built library is as long as its ELF header says (its section headers come
    last). One cut short (a full disk, a killed link) is not imported: mapping it would
    kill the process (SIGBUS) instead of failing the import."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        size = path.stat().st_size
    except OSError:
        return False
    wide = head[4:5] == b"\x02"  # ELF64: 8-byte offsets
    if (
        head[:4] != b"\x7fELF"
        or head[4:5] not in (b"\x01", b"\x02")
        or len(head) < (64 if wide else 52)
    ):
        _log.warning("mpfunc: the cached native CPU kernel %s is not a library; building it "
                     "again", path)  # fmt: skip
        return False
    order = "<" if head[5] == 1 else ">"
    (table,) = struct.unpack_from(order + ("Q" if wide else "I"), head, 0x28 if wide else 0x20)
    entry, count = struct.unpack_from(order + "HH", head, 0x3A if wide else 0x2E)
    if size >= table + entry * count:
        return True
    _log.warning("mpfunc: the cached native CPU kernel %s is cut short (%d of %d bytes); "
                 "building it again", path, size, table + entry * count)  # fmt: skip
    return False


def _discard(build_dir: Path, name: str) -> None:
    """Removes a built library that does not import and the object files it was linked
    from (damaged alike, perhaps), so that torch's build makes both again. Under torch's
    own build lock: where another process holds it, that process is building this folder
    now; its library is waited for and kept."""
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(str(build_dir / "lock"))  # type: ignore[no-untyped-call]
    if not baton.try_acquire():  # type: ignore[no-untyped-call]
        baton.wait()  # type: ignore[no-untyped-call]
        return
    try:
        for f in (build_dir / f"{name}.so", *build_dir.glob("*.o")):
            f.unlink(missing_ok=True)
    finally:
        baton.release()  # type: ignore[no-untyped-call]


def load() -> ModuleType:
    """Builds (first time only) and imports the native module, once per process.

    Returns:
      The extension module, with ``adam_mixed_`` and ``cast_``.

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
        try:
            module = _build(_build_name(_cflags()), _cflags())
        except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as e:
            _error = NativeBuildError(f"mpfunc native kernel unavailable: build failed: {e}")
            raise _error from e
        _module = module
        return module


def loaded() -> bool:
    """Whether the module is built and loaded (never builds)."""
    return _module is not None


_cache_looked = False


def key_function() -> Any:
    """The built module's ``meta_key`` (the memo key of a list of leaves, see
    ``_cache.leaf_keys``), or ``None``. Never builds (on an AVX512_BF16 CPU it may run the
    flag's compiler probe once, ``_has_avx512_bf16``); but where this build is in the cache
    already, loads it (once, ~0.1 s) the first time a key is asked for: keys made before
    the module loads (in Python) never equal keys made after (in C++), so a process whose
    first step loaded the module would check its second step in full again (3-4 s at
    100,000 leaves)."""
    global _cache_looked
    if _module is None and not _cache_looked:
        _cache_looked = True
        if _error is None and not _disabled():
            name = _build_name(_cflags())
            if (cache_dir() / name / f"{name}.so").is_file():
                with contextlib.suppress(NativeUnavailable):
                    load()
    return getattr(_module, "meta_key", None)


# The checks' memo keys use the packer (through the module's global: tests replace it).
_cache.use_packed_keys(lambda: key_function())


def available() -> bool:
    """Whether the native kernels can run here, building them on the first call.

    When they cannot (no compiler, no ninja, a failed build), warns once per process
    with the reason, and returns False: callers use torch's kernels. ``MPFUNC_NATIVE=0``
    returns False without a warning.
    """
    global _warned
    if _module is not None:
        return True
    try:
        load()
    except NativeUnavailable as e:
        if not _warned and not _disabled():
            _warned = True
            warnings.warn(
                f"{e}; using torch's kernels instead (set {_ENV_SWITCH}=0 to silence this)",
                NativeFallbackWarning,
                stacklevel=2,
            )
        return False
    return True


def build_info() -> dict[str, Any]:
    """Where the loaded module lives, its flags, whether it was cached, and the seconds
    the first ``load`` took (``build_s``: compiling, None when it came from the cache)."""
    return dict(_info)


# --- the optimizers' entries (their adapters live in optim/_<name>.py) ------------------------


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
    incremented steps (bit for bit for finite values on x86 torch 2.4 to 2.9), then
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
      found_inf: a one-element float or bool CPU tensor; when it is nonzero nothing is
        written, step counts included.

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


def plain(master: Any, moment: Any) -> bool:
    """Whether a leaf is an fp32 master with fp32 moments (``adam_mixed_`` takes it; any
    other (strategy, state format) pair takes the composed entries)."""
    return isinstance(master, torch.Tensor) and getattr(moment, "dtype", None) == torch.float32


# The native codes of the master strategies and state formats (csrc: composed::Strategy,
# composed::Format). A strategy missing here, or a format whose ``StateFormat.native``
# is ``None``, takes torch's kernels.
STRATEGY_CODES = {"fp32": 0, "remainder": 1, "kahan": 2, "stochastic": 3, "none": 4}
FORMAT_CODES = {f.key: f.native for f in _state_format.FORMATS.values() if f.native is not None}
# The format codes whose stores draw random bits: the pass takes each leaf's salt.
_SALTED = {f.native for f in _state_format.FORMATS.values() if f.salted}


def salts(group: Group, fmt: int) -> list[int]:
    """The group's salts where format ``fmt``'s store draws random bits, else none."""
    return list(group.salts or []) if fmt in _SALTED else []


def composed_args(group: Group, moments: list[Any]) -> tuple[Any, ...]:
    """A group's strategy and state-format codes and its tensors as the composed entries
    take them: (strategy, format, prims, auxs, data, scales). ``moments``: the state
    fields, each a list over the group's leaves (none: format 0). A format with a
    container passes its tensors as (data, scales), in the container's field order."""

    first: Any = group.params[0]
    kind = _strategy.by_unit(first)
    strategy = STRATEGY_CODES["fp32" if kind is None else kind.name]
    held = _state_format.of_moment(moments[0][0]) if moments else None
    quantized = held is not None and held.container is not None
    fmt = 0 if held is None else held.native
    units: list[Any] = list(group.params)
    prims = units if kind is None else [u.param for u in units]
    auxs = [u[1] for u in units] if kind is not None and len(first) > 1 else []
    if kind is not None and len(first) > 2:  # "remainder": the remainders, then the tie bits
        auxs += [u[2] for u in units]
    data = [[q[0] for q in f] for f in moments] if quantized else moments
    scales = [[q[1] for q in f] for f in moments] if quantized else []
    return strategy, fmt, prims, auxs, data, scales


def rule_step(group: Group, rule: int, moment: Any, a: float, b: float, h: Any) -> None:
    """``step_rule_``: SGD (``rule`` 0: ``a``, ``b`` = momentum, dampening) or Lion (1: beta1,
    beta2) over any strategy and state format; ``h`` gives ``weight_decay``, ``maximize``
    and (SGD) ``nesterov``."""
    strategy, fmt, prims, auxs, data, scales = composed_args(
        group, [] if moment is None else [moment]
    )
    lr = group.lr
    load().step_rule_(
        rule, strategy, fmt, prims, auxs, group.grads, data, scales, group.state.step,
        group.model or [], 0.0 if isinstance(lr, torch.Tensor) else float(lr),
        lr if isinstance(lr, torch.Tensor) else None, float(a), float(b),
        float(h.weight_decay), bool(getattr(h, "nesterov", False)), bool(h.maximize),
        group.scale, group.skip,
    )  # fmt: skip


# Whether step_rule_ gives this torch's bits, per (rule kernel, variant): decided once.
_serving: dict[tuple[Any, Any], bool] = {}


def serves(kernel: Any, h: Any) -> bool:
    """Whether the native ``kernel`` can take a rule's leaves here: the module is available
    (built on the first call, as ``available``) and, for a kernel registered with
    ``register_rule`` (SGD's and Lion's), it writes exactly what this process's torch
    writes on the torch path.

    Their bits rest on how torch's foreach ops round (every multiply-add an FMA in the
    vector loop and the tail; lerp's tail form, which differs at a weight of 1, on the last
    ``len % 16`` elements of each thread's part), probed on torch 2.9's AVX512, AVX2 and
    DEFAULT kernels. Another torch may round otherwise, so each process runs both on probe
    leaves once per variant (lengths that end in every kind of tail, signed zeros, a later
    step, float and tensor lrs; Lion with a zero beta is a variant of its own) before using
    the pass, like ``cast_agrees``; where they differ, the rule keeps the torch path.
    """
    if not available():
        return False
    if kernel not in _RULES:
        return True
    variant = _RULES[kernel][4](h)
    key = (kernel, variant)
    if key not in _serving:
        with torch.no_grad():
            _serving[key] = _rule_probe(kernel, variant)
        if not _serving[key]:
            _log.info("mpfunc: %s.%s differs from this torch's foreach ops; using those",
                      kernel.__module__, kernel.__name__)  # fmt: skip
    return _serving[key]


# kernel -> (state maker, its field, the torch path's kernel, cases(variant), variant(h)):
# each rule's module registers its own (register_rule), so this layer never imports the
# optimizers.
_RULES: dict[Any, tuple[Any, str, Any, Any, Any]] = {}


def register_rule(
    kernel: Any, make: Any, field: str, spec: Any, cases: Any, variant: Any = None
) -> None:
    """Registers how ``serves`` probes a rule kernel against its torch path: ``make`` builds
    the state from ``step`` and ``field`` lists, ``spec`` is the torch path's kernel,
    ``variant(h)`` says which probe the hyperparameters ``h`` need (a hashable; by default
    one for all) and ``cases(variant)`` gives the (hyperparameters, lr) pairs to run."""
    _RULES[kernel] = (make, field, spec, cases, variant or (lambda h: None))


def _rule_probe(kernel: Any, variant: Any) -> bool:
    from mpfunc.core._optimizer import Group

    if kernel not in _RULES:
        return False
    make, field, spec, cases_of, _ = _RULES[kernel]
    cases: list[tuple[Any, Any]] = cases_of(variant)
    gen = torch.Generator().manual_seed(0)
    sizes = (7, 40, 1000, 40017)  # tails of 7, 8 and 17 (two parts from 2 threads)
    for h, lr in cases:
        ps = [torch.randn(n, generator=gen) for n in sizes]
        gs = [torch.randn(n, generator=gen) for n in sizes]
        for g in gs:
            g[::3] = -0.0  # (lerp's two forms differ in a zero's sign)
        ms = [torch.randn(n, generator=gen) for n in sizes]
        runs = []
        for run in (spec, kernel):
            state = make(step=[torch.ones(()) for _ in sizes], **{field: [m.clone() for m in ms]})
            group = Group([p.clone() for p in ps], gs, state, lr, None)
            run(group, h)
            runs.append([*group.params, *getattr(state, field), *state.step])
        for x, y in zip(*runs):
            if not torch.equal(x.view(torch.int32), y.view(torch.int32)):
                return False
    return True


# --- casts ------------------------------------------------------------------------------------

# (to, from) pairs cast_ converts, each bit for bit as Tensor.to for every non-NaN value.
_CASTS = frozenset(
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
     (torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
)  # fmt: skip
# Below this many elements in a group, torch's per-tensor copies are as quick.
CAST_FROM_NUMEL = 1 << 16
_agreeing: Optional[frozenset[tuple[torch.dtype, torch.dtype]]] = None


def casts(to: torch.dtype, of: torch.dtype, numel: int) -> bool:
    """Whether ``cast_`` is worth trying for a CPU group of ``numel`` elements in all from
    ``of`` to ``to`` (checked without building; the caller checks layouts, then
    ``cast_agrees``)."""
    return (to, of) in _CASTS and numel >= CAST_FROM_NUMEL and not _disabled()


def _probe(dtype: torch.dtype) -> list[torch.Tensor]:
    """NaNs with payloads (quiet, signalling, both signs), ties, subnormals and infinities
    of ``dtype``, alone and at lengths that end in torch's vector loop and in its scalar
    tail; for 16-bit types also every pattern."""
    if dtype.itemsize == 2:
        raw = [0x7C01, 0x7E00, 0xFC01, 0xFE55, 0x7D23, 0x7F81, 0x7FC0, 0xFF81, 0xFFC1, 0x7FA5,
               0x0001, 0x8001, 0x7C00, 0x7F80]  # fmt: skip
        ints, bits = torch.int16, 16
    else:
        raw = [0x7FD12345, 0xFF812345, 0x7F800001, 0xFFC00000, 0x7FC00000, 0x3F808000,
               0x3F818000, 0x00008000, 0x00000001, 0x7F7FFFFF, 0x7F800000, 0x477FF000,
               0x387FE000, 0x33000001, 0xBF808000]  # fmt: skip
        ints, bits = torch.int32, 32
    wrap = [v - (1 << bits) if v >= 1 << (bits - 1) else v for v in raw]
    special = torch.tensor(wrap, dtype=torch.int64).to(ints).view(dtype)
    probes = [
        special,
        *(special[i : i + 1] for i in range(len(raw))),
        special.repeat(8)[:7],
        special.repeat(8)[:39],
    ]
    if dtype.itemsize == 2:
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(ints).view(dtype)
        probes.append(torch.cat([every, special[:7]]))
    return probes


def cast_agrees(to: torch.dtype, of: torch.dtype) -> bool:
    """Whether ``cast_`` (building it if needed) writes exactly what this torch's
    ``Tensor.to`` writes from ``of`` to ``to``, NaN bits included.

    Decided once per process by casting probes both ways. torch's CPU casts run its
    vector conversion on most elements and, for some dtype pairs and versions, a scalar
    one on each thread's last few, which writes NaNs differently (torch 2.9: float16 to
    float32; torch 2.4: float32 to float16 as well). No kernel can match bits that
    depend on torch's thread split, so such pairs stay with torch's copy.
    """
    global _agreeing
    if not available():
        return False
    if _agreeing is None:
        ok = set()
        with torch.no_grad():
            for t, o in _CASTS:
                probes = _probe(o)
                got = [torch.empty(p.shape, dtype=t) for p in probes]
                load().cast_(got, probes)
                ints = {2: torch.int16, 4: torch.int32}[t.itemsize]
                if all(torch.equal(g.view(ints), p.to(t).view(ints)) for g, p in zip(got, probes)):
                    ok.add((t, o))
        _agreeing = frozenset(ok)
    return (to, of) in _agreeing


def cast_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for CPU lists of one dtype pair (see ``casts``), each pair
    dense with one stride, in one parallel pass: bit for bit ``Tensor.to`` for non-NaN
    values, and for NaN too where ``cast_agrees``."""
    load().cast_(list(dst), list(src))


def main() -> int:
    """Builds the kernels now (CI does this before the tests) and says how long it took."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        load()
    except NativeUnavailable as e:
        print(f"mpfunc native kernel: unavailable: {e}")
        return 0
    info = build_info()
    how = f"built in {info['build_s']:.0f} s" if info["build_s"] is not None else "cached"
    print(
        f"mpfunc native kernel: {how} ({time.perf_counter() - start:.1f} s to load), {info['path']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
