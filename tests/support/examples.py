"""Loading a script of examples/ as a module, to call its functions from a test."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    """``examples/NAME.py``, imported afresh (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
