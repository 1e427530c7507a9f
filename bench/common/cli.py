"""The command-line pieces every benchmark's ``__main__`` shares (no torch: parents import it).

Each benchmark parses its own flags; these fill in a preset's schedule, read comma lists,
and write or re-render its ``<name>.md`` and ``<name>.png`` from a result.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.common.report import read_json


def fill_schedule(args: argparse.Namespace, schedules: Mapping[str, tuple[int, int, int]]) -> None:
    """``--warmup``, ``--blocks`` and ``--steps`` from the preset where not given."""
    warmup, blocks, steps = schedules[args.preset]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.blocks = blocks if args.blocks is None else args.blocks
    args.steps = steps if args.steps is None else args.steps


def names(p: argparse.ArgumentParser, flag: str, value: str, choices: Sequence[str]) -> list[str]:
    """A comma list of names, each among ``choices`` (at least one), or a parser error."""
    got = [m.strip() for m in value.split(",") if m.strip()]
    bad = sorted(set(got) - set(choices))
    if bad or not got:
        p.error(f"{flag}: unknown {', '.join(bad)}; choose among {', '.join(choices)}")
    return got


def counts(p: argparse.ArgumentParser, flag: str, value: str, what: str) -> list[int]:
    """A comma list of integers >= 1 (sorted, each once), or a parser error."""
    try:
        got = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        p.error(f"{flag}: expected comma-separated integers, got {value!r}")
    if not got or got[0] < 1:
        p.error(f"{flag}: expected {what} >= 1")
    return got


def render(name: str, report: ModuleType, result: dict[str, Any], out: Path) -> str:
    """Writes ``<name>.md`` and ``<name>.png`` from a result (fresh, or read back) with the
    benchmark's ``report`` module; returns the table."""
    table: str = report.markdown(result)
    (out / f"{name}.md").write_text(table)
    report.plot(result, out / f"{name}.png")
    return table


def rerender(name: str, report: ModuleType, out: Path, say: Callable[[str], None]) -> int:
    """``--render-only``: rewrites the table and plot from ``<name>.json`` in ``out``."""
    table = render(name, report, read_json(out / f"{name}.json"), out)
    say(f"rewrote {name}.md and {name}.png in {out}")
    sys.stdout.write(table)
    return 0
