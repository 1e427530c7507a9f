"""A cached native library that does not import (or is truncated) is built again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from torch.utils import cpp_extension

from mpfunc.backends import _native
from tests.support.native import native_module


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process where the native module is not loaded yet, building into ``tmp_path``."""
    if _native._why_not() is not None:
        pytest.skip(f"the native kernel cannot be built here: {_native._why_not()}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_error", None)
    monkeypatch.setattr(_native, "_warned", False)
    monkeypatch.setattr(_native, "_info", {})
    return tmp_path


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("stub", "is not a library"),
        ("cut short", "is cut short"),
        ("another module", "does not import"),
    ],
)
def test_a_cached_library_that_does_not_import_is_built_again(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    native: Any,
    empty_cache: Path,
    damage: str,
    said: str,
) -> None:
    """Issue 20, item 8: a cached library that failed to import was imported again by
    torch's build, which found it up to date: every process warned and ran torch's kernels
    until the folder was deleted by hand. Now the library and the object files it was
    linked from are removed and the build runs again. A library cut short is not even
    imported (mapping it kills the process with SIGBUS)."""
    real = Path(native.__file__).read_bytes()
    name = "mpfunc_native_0123456789abcdef"
    monkeypatch.setattr(_native, "_build_name", lambda cflags: name)
    folder = empty_cache / name
    folder.mkdir()
    library = {"stub": real[:16], "cut short": real[: len(real) // 2], "another module": real}
    (folder / f"{name}.so").write_bytes(library[damage])  # the last: no PyInit_<name>
    (folder / "adam_mixed.o").write_bytes(b"\x7fELF")
    (folder / "build.ninja").write_text("# kept\n")
    seen: list[list[str]] = []
    built = types.ModuleType(name)

    def build(**kwargs: Any) -> types.ModuleType:  # torch's cpp_extension.load
        assert kwargs["build_directory"] == str(folder)
        seen.append(sorted(p.name for p in folder.iterdir()))
        return built

    monkeypatch.setattr(cpp_extension, "load", build)
    with caplog.at_level("WARNING", logger="mpfunc"):
        assert _native.load() is built
    assert seen == [["build.ninja"]]  # no library, no object file, no lock left
    assert _native.build_info()["build_s"] is not None
    assert any(
        said in r.getMessage() and "building it again" in r.getMessage() for r in caplog.records
    )


@pytest.mark.slow
def test_a_truncated_library_in_the_cache_is_rebuilt_for_real(
    native: Any, empty_cache: Path
) -> None:
    """The same with torch's build: a copy of this machine's build folder whose library is
    cut in half is compiled again in a fresh process, which then runs the native step."""
    built = Path(native.__file__).parent
    folder = empty_cache / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock"))
    so = folder / Path(native.__file__).name
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    script = (
        "import warnings; warnings.simplefilter('error')\n"
        "from mpfunc.backends import _native\n"
        "_native.load()\n"
        "print(_native.build_info()['build_s'] is not None, _native.key_function() is not None)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(empty_cache)}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"], run.stdout + run.stderr[-3000:]
    assert "is cut short" in run.stderr and "building it again" in run.stderr
    assert so.stat().st_size > 0 and not (folder / "lock").exists()
