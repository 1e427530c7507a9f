"""The native CPU kernel for the tests that need it: skipped only without a toolchain."""

from __future__ import annotations

from typing import Any

import pytest

from mpfunc.backends import _native


def native_module() -> Any:
    """The built module (once per process). Skips where no compiler or ninja can build it
    (or ``MPFUNC_NATIVE=0``); a failed build is a defect and raises ``NativeBuildError``."""
    try:
        return _native.load()
    except _native.NativeBuildError:
        raise
    except _native.NativeUnavailable as e:
        pytest.skip(str(e))
