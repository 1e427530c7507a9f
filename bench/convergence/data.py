"""The convergence corpus: the Python standard library's own source, read offline.

Files are listed in sorted order and shuffled with a fixed seed; whole files are
then held out for validation whenever val holds under a tenth of the text, so no file
is split between the two sets.
Text is mapped to a fixed 98-symbol vocabulary (tab, newline, printable ASCII,
and one symbol for anything else), so token ids do not depend on which files
a Python version ships.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Parts of the stdlib that are not ordinary library source: tests, bundled tools, installs.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VOCAB = ["\t", "\n", *(chr(c) for c in range(32, 127)), "\N{REPLACEMENT CHARACTER}"]
_UNK = len(VOCAB) - 1
_LUT = torch.full((0x110000,), _UNK, dtype=torch.uint8)
for _i, _ch in enumerate(VOCAB[:-1]):
    _LUT[ord(_ch)] = _i
VAL_FRACTION = 0.1  # of the characters, in whole files


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 token ids
    val: torch.Tensor
    root: str
    n_train_files: int
    n_val_files: int
    sha256: str  # of the selected text, train then val


def stdlib_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside tests and installed packages, sorted."""
    files = [
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def encode(text: str) -> torch.Tensor:
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
    return _LUT[codes.long()]


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


def load(max_chars: int, seed: int) -> Corpus:
    """About ``max_chars`` characters of stdlib source, split by file into train and val."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise SystemExit(f"no .py files under the stdlib at {root}")
    random.Random(seed).shuffle(files)
    train: list[str] = []
    val: list[str] = []
    total = 0
    n_val = 0
    for path in files:
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        # The next file, whatever its size, goes to val while val is under its share.
        if n_val < VAL_FRACTION * total:
            val.append(text)
            n_val += len(text)
        else:
            train.append(text)
        total += len(text)
    train_text, val_text = "".join(train), "".join(val)
    digest = hashlib.sha256((train_text + val_text).encode("utf-8", "replace")).hexdigest()
    return Corpus(encode(train_text), encode(val_text), str(root), len(train), len(val), digest)
