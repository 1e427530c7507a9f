"""Helpers shared by the tests split out of tests/test_entry_checks.py."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

import mpfunc
from tests.support.helpers import assert_bits_equal

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _params() -> dict[str, torch.Tensor]:
    """Two bf16 params and one fp16 param: with bf16 and fp16 grads, three leaves in two
    native groups (one per grad dtype), the fp16 one last."""
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, generator=gen).to(BF16),
        "b": torch.randn(8, 8, generator=gen).to(BF16),
        "c": torch.randn(40, generator=gen).to(F16),
    }


def _grads(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in _params().items()}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _holds(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0 or t.numel() == 0


def _snapshot(obj: Any) -> list[tuple[torch.Tensor, torch.Tensor | None, int | None]]:
    """Each tensor with a copy of its values (none where its storage is freed) and its
    version (none for an inference tensor, which keeps no version counter)."""
    return [
        (t, t.detach().clone() if _holds(t) else None, None if t.is_inference() else t._version)
        for t in _tensors(obj)
    ]


def _assert_unchanged(snap: list[tuple[torch.Tensor, torch.Tensor | None, int | None]]) -> None:
    for t, before, version in snap:
        if version is not None:
            assert t._version == version, f"a {tuple(t.shape)} input was written in place"
        if before is None:
            assert not _holds(t)
        else:
            assert_bits_equal(t.detach().clone(), before)


def _refused(
    exc: type[Exception], regex: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> None:
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``regex`` and writes nothing.

    A failure is reported as a plain message, from this hidden frame: pytest prints the
    arguments of the frames it shows, and the repr of a freed tensor would crash it."""
    __tracebackhide__ = True
    before = _snapshot((args, kwargs))
    try:
        fn(*args, **kwargs)
    except exc as e:
        message = str(e)
    except Exception as e:
        raise AssertionError(f"expected {exc.__name__}, got {type(e).__name__}: {e}") from None
    else:
        raise AssertionError(f"expected {exc.__name__}, nothing was raised") from None
    try:
        _assert_unchanged(before)
    except AssertionError as e:
        raise AssertionError(f"{e} (then refused with: {message})") from None
    if not re.search(regex, message):
        raise AssertionError(f"{message!r}\ndoes not match\n{regex!r}") from None


def _at(fn: str, path: str, expected: str) -> str:
    """The regex of mpfunc's message about one leaf, up to ``expected`` (literal text)."""
    return "^" + re.escape(f"{fn}: at {path!r}: expected {expected}")


def _setup(**kwargs: Any) -> tuple[Any, Any, Any, Any, Any]:
    params = _params()
    opt = mpfunc.adamw(lr=1e-2, **kwargs)
    masters = mpfunc.init_master(params)
    return params, masters, _grads(), opt.init(masters), opt
