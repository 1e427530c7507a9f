"""One-off: splits test files named after issues into files named after what they test.

``python scripts/split_tests.py`` (from the repository root, after restructure.py). Each
source file is cut at its ``# --- ...`` section markers; each section goes, whole, to the
new target file the table below names (several sections may share one). Imports and
``pytestmark`` go to every target (ruff removes the unused ones). A module-level helper
(function, class, constant) goes with the target whose tests use it; one used by several
targets goes, once, to ``tests/support/<source stem>.py``, which those targets import from
(fixtures are copied: imported, they would read as unused). Test functions are moved
verbatim: nothing is renamed or changed, so each check keeps its count.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# source -> [(the section header's text, up to its dashes, or "" for what precedes the
# first header), target file stem, the target's docstring if this section creates it)]
Split = list[tuple[str, str, str]]
TABLE: dict[str, Split] = {
    "test_hardening": [
        ("", "-", ""),
        ("optimizers", "-", ""),
        (
            "5. every check",
            "test_checks_before_write",
            "Every check of the in-place transforms runs before any write: a table of sparse,\n"
            "expanded, float8, aliased and second-group faults for every in-place function, each\n"
            "raising the right exception with a message naming the pytree path, what was expected\n"
            "and what arrived, and leaving every input's bits and ``_version`` as they were\n"
            "(``error_table.check_row``); partition's cross-label aliasing and state errors.",
        ),
        (
            "1. one tensor",
            "test_checks_aliasing",
            "One tensor under two names (tied weights, views, detached copies, expanded XLA\n"
            "tensors) is refused naming both paths; tied ``named_parameters`` train once, as\n"
            "torch.optim does; int buffers and adjacent views are not aliases.",
        ),
        (
            "2. partition",
            "test_partition_labels",
            "``partition``'s labelling function: labels follow each tree's own shapes and dtypes,\n"
            "and a leaf that was ``None`` in the first tree is updated.",
        ),
        (
            "3. all_finite",
            "test_finite_dtypes",
            "``all_finite`` checks each leaf in its own dtype: float64 values beyond float32's\n"
            "range are finite.",
        ),
        (
            "4. complex",
            "test_master_dtypes",
            "Complex params are refused naming the path; float64 params get float64 masters and\n"
            "train bit for bit as torch.optim in float64; a master narrower than its param is\n"
            "refused.",
        ),
        (
            "6. XLA",
            "test_xla_buffers",
            "On XLA, params, masters and state never share a device buffer: every tensor stays\n"
            "readable after each step, and a transform's result shares no buffer with its input.",
        ),
        (
            "7. error paths",
            "test_checks_scaling",
            "Error paths are linear in the number of leaves: a bad last leaf of 10,000 is found\n"
            "fast.",
        ),
        (
            "8. the pure forms",
            "test_pure_forms",
            "The pure forms return detached results and grow no autograd graph.",
        ),
        (
            "9. a skipped step",
            "test_apply_update_skip",
            "A skipped step changes no bit of masters or state, at any step count.",
        ),
        (
            "10. layouts",
            "test_layouts_pairing",
            "Layouts: init_grads and init_master follow the param's layout, grads_to_fp32 and\n"
            "accumulate_grads keep the destination's layout and pair elements by index, and the\n"
            "fused step with unlike master and grad layouts matches torch.optim.",
        ),
    ],
    "test_user_edge": [
        (
            "",
            "test_checkpoint_paths",
            "Checkpoint files at the user's edge: temps left by killed saves are removed, forged\n"
            "files are refused, paths that name a folder and file objects are refused before\n"
            "anything is written, bytes paths are accepted.",
        ),
        ("item 9", "test_checkpoint_paths", ""),
        (
            "item 12",
            "test_optimizer_misuse",
            "A functional optimizer used as a torch.optim one (``zero_grad``, ``step``,\n"
            "``param_groups``, an LR scheduler): errors that point to the fix; the optimizer\n"
            "stays a plain NamedTuple.",
        ),
        (
            "item 1",
            "test_param_writes",
            "A param written behind the step's back (``.data``, ``copy_``, a load) is the truth:\n"
            "the next step refreshes its master from it, on every impl, layout and device, and in\n"
            "MasterOptimizer.",
        ),
    ],
    "test_entry_checks": [
        ("", "-", ""),
        (
            "item 3: MasterOptimizer",
            "test_master_optimizer_load",
            "A refused ``MasterOptimizer.load_state_dict`` leaves a frozen param without master\n"
            "or state.",
        ),
        (
            "item 6",
            "test_checks_storage",
            "Freed storage (``untyped_storage().resize_(0)``) in any tree is refused before the\n"
            "first write, also after a remembered (memoized) step; checks name the leaf with\n"
            "units.",
        ),
        (
            "item 3: inference",
            "test_checks_inference",
            "Inference tensors: refused where they would be written, before any write, also in a\n"
            "second group and after a step remembered in inference mode; read where only read.",
        ),
        (
            "item 5",
            "test_checks_views",
            "Negative and conjugate views: read as their values (grads, casts, after a remembered\n"
            "step), refused where they would be written.",
        ),
        (
            "item 11",
            "test_checks_no_grads",
            "A step that would train nothing: all-``None`` grads and grads read from a state dict\n"
            "are errors naming the likely causes; some ``None`` grads still step the others.",
        ),
        (
            "item 8",
            "test_native_cache",
            "A cached native library that does not import (or is truncated) is built again.",
        ),
    ],
}


def sections(src: str) -> list[tuple[str, int]]:
    """``(title, first line)`` of each ``# --- title ---`` section (1-based); ``("", 1)`` first."""
    out = [("", 1)]
    for i, line in enumerate(src.splitlines(), 1):
        if line.startswith("# --- "):
            out.append((line[6:].rstrip("- ").strip(), i))
    return out


def names_used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.value.id
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }


def defined(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            out += [e.id for e in elts if isinstance(e, ast.Name)]
        return out
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def is_import(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    if (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    ):
        return True
    if isinstance(node, ast.Assign) and defined(node) == ["pytestmark"]:
        return True
    # x = pytest.importorskip(...)
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "attr", "") == "importorskip"
    )


def is_fixture(node: ast.stmt) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any("fixture" in ast.unparse(d) for d in decorators)


def is_test(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(
        ("test_", "Test")
    )


def split(stem: str, plan: Split) -> None:
    path = TESTS / f"{stem}.py"
    src = path.read_text()
    lines = src.splitlines(keepends=True)
    tree = ast.parse(src)
    secs = sections(src)
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body
    for (title, _), (want, _target, _doc) in zip(secs, plan, strict=True):
        assert title.startswith(want), (stem, title, want)
    starts = [line for _, line in secs]

    def section_of(node: ast.stmt) -> int:
        first = (
            node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        )
        return max(i for i, s in enumerate(starts) if s <= first)

    def text(node: ast.stmt) -> str:
        first = (
            node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        )
        # Comments right above a statement belong to it.
        while (
            first > 1
            and lines[first - 2].startswith("#")
            and not lines[first - 2].startswith("# ---")
        ):
            first -= 1
        return "".join(lines[first - 1 : node.end_lineno])

    imports = [text(n) for n in body if is_import(n) and defined(n) != ["pytestmark"]]
    marks = [text(n) for n in body if defined(n) == ["pytestmark"]]
    helpers = {name: n for n in body if not is_import(n) and not is_test(n) for name in defined(n)}
    tests_by_target: dict[str, list[ast.stmt]] = {}
    for n in body:
        if is_test(n):
            tests_by_target.setdefault(plan[section_of(n)][1], []).append(n)
    for n in body:
        if not is_import(n) and not is_test(n) and not defined(n):
            raise SystemExit(
                f"{stem}:{n.lineno}: a module-level statement this script cannot place"
            )

    def closure(nodes: list[ast.stmt]) -> set[str]:
        need: set[str] = set()
        todo = [u for n in nodes for u in names_used(n)]
        while todo:
            u = todo.pop()
            if u in helpers and u not in need:
                need.add(u)
                todo.extend(names_used(helpers[u]))
        # fixtures are named by parameters
        for n in nodes:
            if isinstance(n, ast.FunctionDef):
                for a in n.args.args:
                    if a.arg in helpers and a.arg not in need:
                        need.add(a.arg)
                        todo = list(names_used(helpers[a.arg]))
                        while todo:
                            u = todo.pop()
                            if u in helpers and u not in need:
                                need.add(u)
                                todo.extend(names_used(helpers[u]))
        return need

    needs = {t: closure(ns) for t, ns in tests_by_target.items()}
    count: dict[str, int] = {}
    for need in needs.values():
        for u in need:
            count[u] = count.get(u, 0) + 1
    # Fixtures stay with each file that uses them: imported, they would read as unused.
    fixtures = {u for u, n in helpers.items() if is_fixture(n)}
    shared = {u for u, c in count.items() if c > 1 and u not in fixtures}
    ordered_helpers = [n for n in body if not is_import(n) and not is_test(n)]
    if shared:
        # a shared helper's own helpers are shared too
        todo = list(shared)
        while todo:
            for u in names_used(helpers[todo.pop()]):
                if u in helpers and u not in shared and u not in fixtures:
                    shared.add(u)
                    todo.append(u)
        support = TESTS / "support" / f"{stem.removeprefix('test_')}.py"
        parts = [
            f'"""Helpers shared by the tests split out of tests/{stem}.py."""\n\n',
            "".join(imports),
            "\n\n",
            "\n\n".join(text(n) for n in ordered_helpers if set(defined(n)) & shared),
            "\n",
        ]
        support.write_text("".join(parts))
        subprocess.run(["git", "add", str(support)], cwd=ROOT, check=True)
    docs = {target: doc for _, target, doc in plan if doc}
    for target, tests in tests_by_target.items():
        out = TESTS / f"{target}.py"
        mine = [n for n in ordered_helpers if set(defined(n)) & (needs[target] - shared)]
        use_shared = sorted(needs[target] & shared)
        chunk = []
        if use_shared:
            mod = f"support.{stem.removeprefix('test_')}"
            chunk.append(f"from {mod} import {', '.join(use_shared)}\n")
        pieces = [text(n) for n in sorted([*mine, *tests], key=lambda n: n.lineno)]
        assert not out.exists(), f"{target}: exists (a target is always a new file)"
        doc = docs[target]
        head = "".join(imports) + "".join(chunk) + "\n" + "".join(marks)
        new = f'"""{doc}"""\n\n' + head + "\n\n" + "\n\n".join(pieces) + "\n"
        out.write_text(new)
        subprocess.run(["git", "add", str(out)], cwd=ROOT, check=True)
    subprocess.run(["git", "rm", "-q", str(path)], cwd=ROOT, check=True)


def main() -> None:
    for stem, plan in TABLE.items():
        if (TESTS / f"{stem}.py").exists():
            split(stem, plan)
    ruff = [sys.executable, "-m", "ruff"]
    subprocess.run(
        [*ruff, "check", "--fix", "-q", "--unsafe-fixes", "--select", "F401,I,E402", "tests"],
        cwd=ROOT,
    )
    subprocess.run([*ruff, "format", "-q", "tests"], cwd=ROOT)


if __name__ == "__main__":
    main()
