"""One-off: moves mpfunc's flat ``_*.py`` modules into subpackages named by role (issue 21).

Run from the repository root on a clean tree: ``python scripts/restructure.py``. It is
idempotent: a module already moved is skipped, and the rewrites only touch old paths, so
it can be re-run on a newer main that still has (or has again) old-path references.

What it does, mechanically:
1. ``git mv mpfunc/_X.py mpfunc/<pkg>/_X.py`` (module basenames unchanged, so every
   ``_X.attr`` in a body stays valid), and ``mpfunc/csrc`` to ``mpfunc/backends/csrc``;
   each new package gets an ``__init__.py`` with a one-line docstring.
2. In every ``.py`` file of mpfunc/, tests/, bench/, examples/, scripts/: each
   ``from mpfunc import _X, _Y`` statement naming a moved module is rewritten (with ast)
   as one ``from mpfunc.<pkg> import _X`` per package (other names stay where they were).
3. In every text file (code, docs, toml, MANIFEST; not bench/results): ``mpfunc._X``
   becomes ``mpfunc.<pkg>._X`` (imports, strings such as monkeypatch targets and
   ``python -m``), ``mpfunc/_X.py`` becomes ``mpfunc/<pkg>/_X.py`` (paths in docs and
   docstrings), and ``from mpfunc import _X`` left in strings (code run in a subprocess)
   becomes ``from mpfunc.<pkg> import _X``.
4. pyproject.toml: the package list and the csrc package data.
Then ``ruff check --fix --select I`` and ``ruff format`` sort and format the imports.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent

PACKAGES: dict[str, tuple[str, list[str]]] = {
    "core": (
        "The ground floor: tree rules, tensor utilities, the checks and their wording, the "
        "optimizer protocol. Imports nothing else of mpfunc.",
        ["_compile", "_gc", "_tree", "_dtensor", "_rng", "_checks", "_optimizer"],
    ),
    "parallel": (
        "Placement across devices: SPMD sharding annotations and gloo/NCCL data parallel.",
        ["_sharding", "_distributed"],
    ),
    "state_formats": (
        "How optimizer moments are stored (float32, bfloat16, 8-bit blocks): one module "
        "per format, and the registry.",
        ["_state_format", "_quantize"],
    ),
    "strategies": (
        "How fp32 masters are held (fp32, none, kahan, remainder, stochastic): one module "
        "per strategy, and the registry.",
        [
            "_strategy",
            "_strategy_fp32",
            "_strategy_none",
            "_strategy_kahan",
            "_strategy_remainder",
            "_strategy_stochastic",
            "_remainder",
        ],
    ),
    "backends": (
        "Where a step runs: the planner that groups leaves into kernel calls, the native "
        "CPU pass (csrc/), the XLA computations.",
        ["_plan", "_native", "_xla_kernels", "_xla_watch", "_diagnostics"],
    ),
    "checkpoint": (
        "State dicts and checkpoint files.",
        ["_checkpoint"],
    ),
    "transforms": (
        "The public functional transforms: init_master, grads_to_fp32, apply_update, "
        "masters_to_model, accumulate, clip, finite, loss scales, policy, partition.",
        [
            "_init_master",
            "_grads_to_fp32",
            "_apply_update",
            "_masters_to_model",
            "_accumulate",
            "_clip",
            "_finite",
            "_loss_scale",
            "_policy",
            "_partition",
        ],
    ),
    "optim": (
        "The optimizers (each one's math and back ends together), torch.optim adapters, "
        "migration and MasterOptimizer.",
        ["_adam", "_sgd", "_lion", "_torch_optim", "_migrate", "_master_optimizer"],
    ),
}

WHERE = {mod: pkg for pkg, (_, mods) in PACKAGES.items() for mod in mods}
CODE_DIRS = ["mpfunc", "tests", "bench", "examples", "scripts"]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".in", ".sh", ".cfg", ".txt", ".cpp", ".h", ".json"}
SELF = pathlib.Path(__file__).resolve()


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def move() -> None:
    for pkg, (doc, mods) in PACKAGES.items():
        d = ROOT / "mpfunc" / pkg
        d.mkdir(exist_ok=True)
        init = d / "__init__.py"
        if not init.exists():
            init.write_text('"""' + textwrap.fill(doc, 92) + '"""\n')
            git("add", str(init.relative_to(ROOT)))
        for mod in mods:
            src = ROOT / "mpfunc" / f"{mod}.py"
            if src.exists():
                git("mv", str(src.relative_to(ROOT)), f"mpfunc/{pkg}/{mod}.py")
    csrc = ROOT / "mpfunc" / "csrc"
    if csrc.exists():
        git("mv", "mpfunc/csrc", "mpfunc/backends/csrc")


def rewrite_from_imports(text: str) -> str:
    """``from mpfunc import _X, name`` -> one statement per package, old names kept."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module == "mpfunc" and node.level == 0):
            continue
        moved = [a for a in node.names if a.name in WHERE]
        if not moved:
            continue
        stay = [a for a in node.names if a.name not in WHERE]
        pad = " " * node.col_offset
        groups: dict[str, list[ast.alias]] = {}
        for a in moved:
            groups.setdefault(WHERE[a.name], []).append(a)
        stmts = []
        if stay:
            stmts.append("from mpfunc import " + ", ".join(alias_text(a) for a in stay))
        for pkg, names in groups.items():
            stmts.append(f"from mpfunc.{pkg} import " + ", ".join(alias_text(a) for a in names))
        end = lines[node.end_lineno - 1]
        tail = end[node.end_col_offset :]  # a trailing comment, the newline
        new = ("\n" + pad).join(stmts)
        head = lines[node.lineno - 1][: node.col_offset]
        edits.append((node.lineno - 1, node.end_lineno, head + new + tail))
    for start, stop, new in sorted(edits, reverse=True):
        lines[start:stop] = [new]
    return "".join(lines)


def alias_text(a: ast.alias) -> str:
    return a.name if a.asname is None else f"{a.name} as {a.asname}"


def rewrite_paths(text: str) -> str:
    for mod, pkg in WHERE.items():
        text = re.sub(rf"\bmpfunc\.{mod}\b", f"mpfunc.{pkg}.{mod}", text)
        text = re.sub(rf"\bmpfunc/{mod}\.py\b", f"mpfunc/{pkg}/{mod}.py", text)
        # What the ast pass cannot see: one-module imports in code held in strings.
        text = re.sub(
            rf"\bfrom mpfunc import {mod}\b(?!,)", f"from mpfunc.{pkg} import {mod}", text
        )
    return re.sub(r"\bmpfunc/csrc\b", "mpfunc/backends/csrc", text)


def text_files() -> list[pathlib.Path]:
    """Tracked text files, but not recorded benchmark results (bench/results: history)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True)
    keep = []
    for name in out.stdout.splitlines():
        f = ROOT / name
        if name.startswith("bench/results/") or f.resolve() == SELF or not f.is_file():
            continue
        if f.suffix in TEXT_SUFFIXES or f.name == "MANIFEST.in":
            keep.append(f)
    return keep


# Module names built at run time, which no pattern above can see.
DYNAMIC = {
    # (and a docstring line that the longer paths would push past 100 characters)
    "tests/test_native.py": [
        (
            "(mpfunc/backends/_native.py, mpfunc/backends/csrc/adam_mixed.cpp)",
            "(mpfunc/backends/_native.py, backends/csrc/adam_mixed.cpp)",
        ),
    ],
    "mpfunc/strategies/_strategy.py": [
        ('import_module(f"mpfunc.{name}")', 'import_module(f"mpfunc.strategies.{name}")'),
    ],
}


def rewrite() -> None:
    for f in text_files():
        text = f.read_text()
        new = rewrite_from_imports(text) if f.suffix == ".py" else text
        new = rewrite_paths(new)
        for old, replacement in DYNAMIC.get(str(f.relative_to(ROOT)), []):
            new = new.replace(old, replacement)
        if new != text:
            f.write_text(new)


def pyproject() -> None:
    f = ROOT / "pyproject.toml"
    text = f.read_text()
    pkgs = ", ".join(['"mpfunc"', *(f'"mpfunc.{p}"' for p in PACKAGES)])
    text = re.sub(r"(?m)^packages = \[.*\]$", f"packages = [{pkgs}]", text)
    text = text.replace(
        'mpfunc = ["py.typed", "csrc/*.cpp", "csrc/*.h"]',
        'mpfunc = ["py.typed"]\n"mpfunc.backends" = ["csrc/*.cpp", "csrc/*.h"]',
    )
    text = text.replace(
        "# csrc: the C++ source that mpfunc._native compiles at run time.",
        "# csrc: the C++ source that mpfunc.backends._native compiles at run time.",
    )
    f.write_text(text)


def main() -> None:
    move()
    rewrite()
    pyproject()
    targets = [d for d in CODE_DIRS if (ROOT / d).exists()]
    ruff = [sys.executable, "-m", "ruff"]
    subprocess.run([*ruff, "check", "--fix", "--select", "I", "-q", *targets], cwd=ROOT)
    subprocess.run([*ruff, "format", "-q", *targets], cwd=ROOT)


if __name__ == "__main__":
    main()
