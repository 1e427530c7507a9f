"""The import graph of mpfunc/: modules in layers, each importing only lower layers, no cycles.

Read from the source with ``ast``, imports inside functions included (a lazy import still
makes a cycle at run time), so this holds without importing anything. The layer table
below is the architecture; a module that fits no layer, or an import that points up, fails
here with the module and the import named.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mpfunc"

# Bottom first. A module may import modules of lower layers and of its own layer's
# packages (within a layer the graph must still be acyclic); never a higher layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # tree rules, tensor utilities, the checks and their wording, the optimizer protocol
    ("core", ("mpfunc.core",)),
    # SPMD sharding annotations, data-parallel collectives
    ("parallel", ("mpfunc.parallel",)),
    # how moments are stored; how masters are held: one module each, and a registry
    ("formats", ("mpfunc.state_formats", "mpfunc.strategies")),
    # the planner, the native CPU pass, the XLA computations
    ("backends", ("mpfunc.backends",)),
    # state dicts and files
    ("checkpoint", ("mpfunc.checkpoint",)),
    # the public functional transforms
    ("transforms", ("mpfunc.transforms",)),
    # the optimizers with their back ends, torch.optim adapters, MasterOptimizer
    ("optim", ("mpfunc.optim",)),
    # the public surface: exactly these two modules (a new module belongs in a package)
    ("public", ("mpfunc", "mpfunc.testing")),
]
_EXACT = {"mpfunc", "mpfunc.testing"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import of an mpfunc module in ``name``, at any depth."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join([*here[: len(here) - node.level + 1], *filter(None, [base])])
            # ``from pkg import mod`` imports a module; ``from mod import name`` the module.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target.startswith("mpfunc") and target != name:
                yield node.lineno, target


def _inside(name: str, package: str) -> bool:
    return name == package or (package not in _EXACT and name.startswith(package + "."))


def _layer(name: str) -> int:
    best = None
    for i, (_, packages) in enumerate(LAYERS):
        for p in packages:
            if _inside(name, p) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{name} is in no layer of LAYERS"
    return best[0]


def _package(name: str) -> str:
    i = _layer(name)
    return max((p for p in LAYERS[i][1] if _inside(name, p)), key=len)


GRAPH = {name: sorted(set(_imports(name, path))) for name, path in MODULES.items()}


def test_every_module_is_in_one_layer() -> None:
    for name in MODULES:
        _layer(name)
    assert len(MODULES) > 40  # the walk found the package


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str) -> None:
    """A module imports lower layers, or its own package; never a higher layer, nor a
    sibling package of its own layer."""
    here = _layer(name)
    for line, target in GRAPH[name]:
        there = _layer(target)
        same_package = _package(target) == _package(name) or name == "mpfunc"
        assert there < here or (there == here and same_package), (
            f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports {target} "
            f"(layer {LAYERS[there][0]!r}) from layer {LAYERS[here][0]!r}"
        )


def test_no_import_cycles() -> None:
    """Depth-first search over every import, lazy ones included."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for _, target in GRAPH[name]:
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in MODULES:
        if name not in state:
            visit(name)


def _eager(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at import: the module body, into if/try/with blocks, but not
    into functions, classes or ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                yield from _eager(node.body)
            yield from _eager(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _eager(part)
        elif isinstance(node, ast.With):
            yield from _eager(node.body)
        else:
            yield node


@pytest.mark.parametrize("name", sorted(MODULES))
def test_torch_xla_is_imported_lazily(name: str) -> None:
    """``import mpfunc`` works (and stays cheap) without torch_xla: it is imported only
    inside the functions that need it."""
    tree = ast.parse(MODULES[name].read_text())
    for node in _eager(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        assert not any(n == "torch_xla" or n.startswith("torch_xla.") for n in names), (
            f"{MODULES[name].relative_to(PACKAGE.parent)}:{node.lineno} imports torch_xla "
            "at import time"
        )
