"""README.md's ```python blocks, and the placeholders they run with (tests/test_readme.py).

A block runs in a namespace that holds
only *placeholders*, the names a reader brings or a snippet takes from its context,
built here at a tiny size:

* always: ``torch`` and ``mpfunc`` (the quickstart's import), and ``MyModel``,
  ``loader`` and ``loss_fn`` (what a reader brings to the quickstart);
* only where the block declares them in an HTML comment just above it (invisible on
  the rendered page), ``<!-- readme-test: uses masters, state, params -->``: the
  names of ``CONTEXT`` below (a snippet from the middle of a loop).

``<!-- readme-test: uses masters, model; strategy remainder -->`` makes the masters
(and their state) with that strategy instead of ``"fp32"`` (a block about
``"remainder"`` masters would otherwise run on a tree that has none, and check nothing).

Other markers: ``<!-- readme-test: distributed uses ... -->`` runs the block in a
subprocess that has joined a one-rank gloo group (``rank``, ``world_size`` given);
``<!-- readme-test: skip REASON -->`` leaves a deliberately partial block out (the
reason is reported). A block that uses a name nobody declared fails with a message
saying how to declare it.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any, NamedTuple

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
# The marker must be the last thing above the fence (blank lines allowed); its text
# cannot contain "-->", so a match never spans two comments.
_MARKER = re.compile(r"<!--\s*readme-test:\s*((?:(?!-->).)*?)\s*-->\s*\Z", re.S)


class Block(NamedTuple):
    line: int  # 1-based line of the opening fence
    code: str
    marker: str  # the text of the readme-test comment above the block, or ""


def blocks(text: str) -> list[Block]:
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()]
        marker = _MARKER.search(before.rstrip() + "\n")
        out.append(Block(before.count("\n") + 1, m.group(1), marker.group(1) if marker else ""))
    return out


# --- placeholders ----------------------------------------------------------------------------

IN, CLASSES, BATCH = 8, 3, 4


class MyModel(torch.nn.Module):
    """A reader's model: a layer, a norm, a head (biases and a 1-d weight for partition)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(IN, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.fc(x))))


def _loader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, IN, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(3)
    ]


def _reader() -> dict[str, Any]:
    import mpfunc

    return {
        "torch": torch,
        "mpfunc": mpfunc,
        "MyModel": MyModel,
        "loader": _loader(),
        "loss_fn": torch.nn.functional.cross_entropy,
    }


def _context(strategy: str = "fp32") -> dict[str, Any]:
    """A training loop in mid-step: a bf16 model after a backward, its masters (of
    ``strategy``), an AdamW state, a loss scale, an lr tensor, and an fp32 copy of the
    model."""
    import mpfunc

    torch.manual_seed(0)
    model = MyModel().to(torch.bfloat16)
    params = dict(model.named_parameters())
    lr = torch.tensor(1e-3)
    opt = mpfunc.adamw(lr=lr, weight_decay=0.1)
    masters = mpfunc.init_master(params, strategy=strategy)
    x, y = _loader()[0]
    model(x.to(torch.bfloat16)).float().sum().backward()  # .grad tensors exist ...
    model.zero_grad(set_to_none=False)  # ... and hold zeros, so `grads` sees later backwards
    return {
        "device": torch.device("cpu"),
        "model": model,
        "params": params,
        "masters": masters,
        "opt": opt,
        "state": opt.init(masters),
        "lr": lr,
        "scaler": mpfunc.DynamicLossScale(),
        "g32_buf": mpfunc.init_grads(params),
        "loss": torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y),
        "grads": {n: p.grad for n, p in params.items()},
        "fp32_model": MyModel(),
        "decay": [p for p in params.values() if p.ndim >= 2],
        "no_decay": [p for p in params.values() if p.ndim < 2],
    }


CONTEXT = ["decay", "device", "fp32_model", "g32_buf", "grads", "loss", "lr", "masters"]
CONTEXT += ["model", "no_decay", "opt", "params", "scaler", "state"]  # (sorted)


def _uses(marker: str) -> list[str]:
    m = re.search(r"\buses\s+([^;]*)", marker)
    names = [n.strip() for n in m.group(1).split(",")] if m else []
    unknown = [n for n in names if n not in CONTEXT]
    assert not unknown, f"readme-test marker: unknown placeholders {unknown}; known: {CONTEXT}"
    return names


def namespace(marker: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__readme__", **_reader()}
    strategy = re.search(r"\bstrategy\s+(\w+)", marker)
    context = _context(strategy.group(1) if strategy else "fp32")
    ns.update({n: context[n] for n in _uses(marker)})
    return ns


def run_block(block: Block, ns: dict[str, Any]) -> None:
    try:
        exec(compile(block.code, f"README.md:{block.line}", "exec"), ns)
    except NameError as e:
        raise AssertionError(
            f"README.md:{block.line}: {e}. If the reader brings this name, declare it: add "
            f"<!-- readme-test: uses NAME --> above the block (names: {CONTEXT}), or extend "
            f"CONTEXT in tests/support/readme.py"
        ) from e
