"""Packaging: one version source, the license, what pyproject.toml claims, and an sdist
that carries its own tests.

These read the installed distribution's metadata (the environment that
scripts/env.sh makes installs mpfunc editable from this clone), so they also prove
that the mpfunc under test is this clone's, in this process and in subprocesses.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from typing import Any

import pytest

import mpfunc

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT: dict[str, Any] = PYPROJECT["project"]
META = importlib.metadata.metadata("mpfunc")


def env_record() -> dict[str, str]:
    """What scripts/env.sh recorded about the running environment; {} for any other."""
    stamp = pathlib.Path(sys.prefix) / "mpfunc-env.txt"
    if not stamp.is_file():
        return {}
    return dict(line.split("=", 1) for line in stamp.read_text().splitlines() if "=" in line)


def release(version: str) -> tuple[int, ...]:
    """'2.4.0+cu121' -> (2, 4, 0)."""
    m = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
    assert m, version
    return tuple(int(p) for p in m.group(0).split("."))


def test_version_has_one_source() -> None:
    """pyproject.toml states the version; the package reads it from the metadata."""
    assert "version" not in PROJECT.get("dynamic", [])
    assert importlib.metadata.version("mpfunc") == PROJECT["version"]
    assert mpfunc.__version__ == PROJECT["version"]
    for f in sorted((REPO / "mpfunc").rglob("*.py")):
        assert f'"{PROJECT["version"]}"' not in f.read_text(), f"{f.name} restates the version"


def test_the_imported_mpfunc_is_this_clone_everywhere(tmp_path: pathlib.Path) -> None:
    """In this process and in a subprocess started outside the clone (as the workers of
    the distributed tests are), `import mpfunc` finds this clone: two clones never test
    each other's code."""
    here = pathlib.Path(mpfunc.__file__).resolve()
    assert here == REPO / "mpfunc" / "__init__.py"
    out = subprocess.run(
        [sys.executable, "-c", "import mpfunc; print(mpfunc.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert pathlib.Path(out.stdout.strip()).resolve() == here


def test_license_is_shipped_and_declared() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert PROJECT["license"] == "Apache-2.0"
    assert META["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (META.get_all("License-File") or [])
    # PEP 639: the expression replaces license classifiers; both together is an error.
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]


def test_python_claims_match_what_is_tested() -> None:
    """requires-python's floor is the oldest Python classifier (the one the oldest-versions
    run uses), and this interpreter satisfies it."""
    floor = re.fullmatch(r">=\s*3\.([0-9]+)", PROJECT["requires-python"])
    assert floor, PROJECT["requires-python"]
    minors = [
        int(m.group(1))
        for c in PROJECT["classifiers"]
        if (m := re.fullmatch(r"Programming Language :: Python :: 3\.([0-9]+)", c))
    ]
    assert min(minors) == int(floor.group(1))
    assert sys.version_info[:2] >= (3, int(floor.group(1)))
    assert META["Requires-Python"] == PROJECT["requires-python"]
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"3.{floor.group(1)}"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py3{floor.group(1)}"


def test_dependency_lower_bounds_are_the_ones_tested() -> None:
    """Every dependency states a lower bound; in the oldest-versions environment the
    installed versions are exactly those bounds, so the run there tests the claim."""
    oldest = env_record().get("profile") == "oldest"
    for req in PROJECT["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9._-]+)\s*>=\s*([0-9.]+)", req)
        assert m, f"{req!r}: state a plain >= lower bound"
        name, bound = m.group(1), release(m.group(2))
        have = release(importlib.metadata.version(name))
        if oldest:
            assert have[: len(bound)] == bound and not any(have[len(bound) :]), (name, have)
        else:
            assert have >= bound, (name, have)


# Made by builds, tests and scripts/env.sh; never part of a source tree.
MADE = {".git", ".venv", ".venv-oldest", "build", "dist", "__pycache__", ".hypothesis"}
MADE |= {".pytest_cache", ".mypy_cache", ".ruff_cache"}


def generated(name: str) -> bool:
    """What building an sdist adds to the source files."""
    return name in {"PKG-INFO", "setup.cfg"} or ".egg-info/" in name


def in_a_git_clone() -> bool:
    if shutil.which("git") is None:
        return False
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=REPO, capture_output=True, text=True
    )
    return top.returncode == 0 and pathlib.Path(top.stdout.strip()).resolve() == REPO


def source_files() -> set[str]:
    """This clone's files that git does not ignore, tracked or not; outside a git clone
    (an unpacked sdist), every file but what builds and tests make."""
    if not in_a_git_clone():
        return {
            rel.as_posix()
            for rel in (p.relative_to(REPO) for p in REPO.rglob("*") if p.is_file())
            if not MADE & set(rel.parts) and not any(x.endswith(".egg-info") for x in rel.parts)
        }
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return {p for p in out.stdout.split("\0") if p and (REPO / p).is_file()}


def build(kind: str, out: pathlib.Path, src: pathlib.Path) -> pathlib.Path:
    """The sdist or wheel built from ``src`` by the declared backend, without isolation
    (setuptools is in the test environment)."""
    code = f"import sys; from setuptools import build_meta as b; print(b.build_{kind}(sys.argv[1]))"
    res = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
    )
    return out / res.stdout.strip().splitlines()[-1]


def sdist_of_this_clone(tmp: pathlib.Path) -> pathlib.Path:
    """The sdist of a copy of the source files alone: setuptools would otherwise reuse
    what earlier builds left in the clone (mpfunc.egg-info/SOURCES.txt, build/)."""
    for f in source_files():
        (tmp / "src" / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tmp / "src" / f)
    return build("sdist", tmp, tmp / "src")


def unpack(sdist: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Extracts the sdist into dest; returns its top folder."""
    # The "data" filter (3.10.12+) refuses links and paths that leave dest.
    safe: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, **safe)
    return dest / f"mpfunc-{PROJECT['version']}"


def test_sdist_carries_the_tests_and_nothing_else(tmp_path: pathlib.Path) -> None:
    """The sdist holds every source file of the clone (what git does not ignore), so that
    its tests, examples, benchmarks and scripts run from it, and adds only metadata."""
    sdist = sdist_of_this_clone(tmp_path)
    prefix = f"mpfunc-{PROJECT['version']}/"
    with tarfile.open(sdist) as tar:
        names = {m.name.removeprefix(prefix) for m in tar.getmembers() if m.isfile()}
    for need in ["pyproject.toml", "README.md", "LICENSE", "NOTES.md", "scripts/test.sh"]:
        assert need in names
    assert {"tests/conftest.py", "tests/test_packaging.py"} <= names
    want = {f for f in source_files() if not generated(f)} - {".gitignore"}
    assert {n for n in names if not generated(n)} == want


def test_wheel_from_the_sdist_carries_the_whole_package(tmp_path: pathlib.Path) -> None:
    """The wheel built from the sdist (as pip builds it) holds every file of mpfunc/:
    modules, py.typed and the C++ source that mpfunc.backends._native compiles at run time."""
    src = unpack(sdist_of_this_clone(tmp_path), tmp_path / "unpacked")
    with zipfile.ZipFile(build("wheel", tmp_path, src)) as whl:
        names = {n for n in whl.namelist() if n.startswith("mpfunc/")}
    assert names == {f for f in source_files() if f.startswith("mpfunc/")}


@pytest.mark.slow
def test_an_unpacked_sdist_sets_up_and_runs_its_tests(tmp_path: pathlib.Path) -> None:
    """Unpacked, the sdist gets its own venv from scripts/env.sh (reusing this machine's
    shared base, so nothing is downloaded) and its packaging tests pass there."""
    record = env_record()
    if record.get("profile") != "full":
        pytest.skip("needs the full environment made by scripts/env.sh")
    root = unpack(sdist_of_this_clone(tmp_path), tmp_path / "unpacked")
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "MPFUNC_VENV"}}
    env.update(MPFUNC_PYTHON=record["python"], MPFUNC_HOME=record["home"])
    setup = subprocess.run(
        ["bash", "scripts/env.sh"], cwd=root, env=env, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stderr
    assert "building the shared" not in setup.stderr, setup.stderr
    py = setup.stdout.strip()
    assert py == str(root / ".venv" / "bin" / "python")
    args = ["-q", "-p", "no:cacheprovider", "-m", "not slow", "tests/test_packaging.py"]
    run = subprocess.run(
        [py, "-m", "pytest", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
