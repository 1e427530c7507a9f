"""Checkpoint files: nothing lost, nothing forged.

Every corrupted byte is an error (the file's seal and each tensor's checksum), a file
declaring more data than it holds is refused before torch.load builds anything, and a
file without checksums (mpfunc 0.1, plain torch.save) needs ``unverified=True``.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import random
import re
import struct
import zipfile
import zlib
from typing import Any

import pytest
import torch
from support.helpers import assert_trees_bits_equal, assert_unchanged, leaves, snapshot
from workers.resume_common import Run

import mpfunc

MANIFEST = "__mpfunc_manifest__"


def full_tree() -> dict[str, Any]:
    """Masters, Adam state (amsgrad) and a dynamic loss scale after two steps: 17 tensors."""
    run = Run(torch.device("cpu"), "adam", True)
    run.train(0, 2)
    return run.tree()


def same_bits(a: Any, b: Any) -> bool:
    for x, y in zip(leaves(a), leaves(b)):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def outcome(path: pathlib.Path, tree: Any, **kwargs: Any) -> str:
    """ "error" (a ValueError, as promised), "same" (loaded the right values) or "WRONG"."""
    try:
        back = mpfunc.load(path, like=tree, **kwargs)
    except ValueError:
        return "error"
    return "same" if same_bits(back, tree) else "WRONG"


def flipped(data: bytes, pos: int, xor: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= xor
    return bytes(out)


# --- integrity ----------------------------------------------------------------------------


def test_every_random_byte_flip_is_detected(tmp_path: pathlib.Path) -> None:
    """500 seeded single-byte corruptions anywhere in a real checkpoint (12.8 kB): every
    one is an error (mpfunc 0.1 loaded 154 of them with wrong values and 175 silently).
    With ``unverified=True`` (no file seal) the per-tensor checksums still leave no
    wrong value."""
    tree = full_tree()
    good = tmp_path / "good.pt"
    mpfunc.save(good, tree)
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    rng = random.Random(0)
    corruptions = [(rng.randrange(len(data)), rng.randrange(1, 256)) for _ in range(500)]
    counts: collections.Counter[str] = collections.Counter()
    for pos, xor in corruptions:
        bad.write_bytes(flipped(data, pos, xor))
        counts[outcome(bad, tree)] += 1
    assert counts == {"error": 500}, counts
    counts.clear()
    for pos, xor in corruptions[::2]:
        bad.write_bytes(flipped(data, pos, xor))
        counts[outcome(bad, tree, unverified=True)] += 1
    assert counts["WRONG"] == 0, counts
    assert_trees_bits_equal(mpfunc.load(good, like=tree), tree)  # the original still loads


def test_every_byte_of_a_small_file_is_covered(tmp_path: pathlib.Path) -> None:
    """A one-bit flip in each byte of a small checkpoint (every zip header, the pickle, the
    manifest, the data, the seal), each bit position in turn: all are errors."""
    tree = {"w": torch.tensor([1.5, -2.0, 3.25]), "step": torch.tensor(7)}
    good = tmp_path / "good.pt"
    mpfunc.save(good, tree)
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    results: collections.Counter[str] = collections.Counter()
    missed = []
    for pos in range(len(data)):
        bad.write_bytes(flipped(data, pos, 1 << (pos % 8)))
        result = outcome(bad, tree)
        results[result] += 1
        if result != "error":
            missed.append(pos)
    assert len(data) > 1000
    assert results == {"error": len(data)}, (results, missed[:20])


def test_a_raw_torch_load_is_verified_by_load_state_dict(tmp_path: pathlib.Path) -> None:
    """Plain ``torch.load`` of a file gives the tensors plus the manifest; handed to
    ``load_state_dict`` (or its twin), every tensor is checked against its checksum."""
    tree = full_tree()
    path = tmp_path / "ck.pt"
    mpfunc.save(path, tree)
    raw = torch.load(path, weights_only=True)
    assert MANIFEST in raw
    assert_trees_bits_equal(mpfunc.load_state_dict(tree, raw), tree)
    raw["masters.0.weight"].view(-1)[3] += 1.0  # one value changed after the fact
    snap = snapshot(tree)
    with pytest.raises(ValueError, match=r"'masters\.0\.weight' does not match its checksum"):
        mpfunc.load_state_dict(tree, raw)
    with pytest.raises(ValueError, match=r"'masters\.0\.weight' does not match its checksum"):
        mpfunc.load_state_dict_(tree, raw)
    assert_unchanged(tree, snap)
    # Re-saved by plain torch.save: no seal, but the manifest still catches the change.
    torch.save(raw, tmp_path / "resaved.pt")
    with pytest.raises(ValueError, match=r"does not match its checksum"):
        mpfunc.load(tmp_path / "resaved.pt", like=tree, unverified=True)
    raw[MANIFEST] = raw[MANIFEST][:-1]  # a damaged manifest is an error too
    with pytest.raises(ValueError, match=r"manifest .* is damaged"):
        mpfunc.load_state_dict(tree, raw)


def test_files_without_checksums_need_unverified(tmp_path: pathlib.Path) -> None:
    """A file written by mpfunc 0.1 (``torch.save`` of the state dict, no checksums) or by
    plain ``torch.save`` gets a clear error by default: a corrupted byte in it could not
    be detected. ``unverified=True`` loads it, still checking sizes, keys and dtypes."""
    tree = full_tree()
    old = tmp_path / "old.pt"
    with open(old, "wb") as f:  # exactly what mpfunc 0.1's save wrote
        torch.save({k: v.cpu() for k, v in mpfunc.state_dict(tree).items()}, f)
    snap = snapshot(tree)
    with pytest.raises(ValueError, match=r"has no mpfunc checksum .* pass unverified=True"):
        mpfunc.load(old, like=tree)
    with pytest.raises(ValueError, match=r"has no mpfunc checksum"):
        mpfunc.load_(old, tree)
    assert_unchanged(tree, snap)
    assert_trees_bits_equal(mpfunc.load(old, like=tree, unverified=True), tree)
    sd = mpfunc.state_dict(tree)
    sd["masters.0.weight"] = sd["masters.0.weight"].double()
    torch.save(sd, old)
    with pytest.raises(ValueError, match=r"expected torch\.float32, got torch\.float64"):
        mpfunc.load(old, like=tree, unverified=True)
    # The reserved key cannot be a leaf's path.
    with pytest.raises(ValueError, match=r"reserved"):
        mpfunc.save(tmp_path / "x.pt", {MANIFEST: torch.zeros(1)})


# --- hostile sizes --------------------------------------------------------------------------


class _Marker:
    pass


def _forge(
    path: pathlib.Path,
    *,
    storage_numel: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    record: bytes,
    key: str = "w",
    names: tuple[str, ...] = ("archive/data/0",),
) -> None:
    """A torch zip holding ``{key: tensor}`` whose pickle declares a float32 storage of
    ``storage_numel`` elements and a view ``size``/``stride`` of it, while the storage's
    record really holds ``record``."""
    marker = _Marker()

    class Rebuild:
        def __reduce__(self) -> tuple[Any, ...]:
            args = (marker, 0, size, stride, False, collections.OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if obj is marker:
                return ("storage", torch.FloatStorage, "0", "cpu", storage_numel)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({key: Rebuild()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for name in names:
            z.writestr(name, record)
        z.writestr("archive/version", "3\n")


def _seal(path: pathlib.Path) -> None:
    """Adds the seal ``save`` writes (the format is documented in mpfunc/checkpoint/_file.py):
    a forger can compute it, so it proves integrity, not authenticity."""
    data = path.read_bytes()
    assert data[-22:-18] == b"PK\x05\x06" and data[-2:] == b"\0\0"
    comment = b"mpfunc-checkpoint v1 crc32=%08x" % zlib.crc32(data)
    path.write_bytes(data[:-2] + struct.pack("<H", len(comment)) + comment)


@pytest.fixture
def no_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if torch.load is reached: hostile files must be refused before."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.load was called on a hostile file")

    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize("numel", [2**16, 2**20])
@pytest.mark.parametrize("sealed", [False, True])
def test_a_storage_larger_than_its_record_is_refused(
    tmp_path: pathlib.Path, numel: int, sealed: bool, no_torch_load: None
) -> None:
    """The pickle declares ``numel`` float32 elements; the record holds 4. torch.load
    would read heap memory into the tensor (2^16) or crash (2^20). mpfunc refuses the
    file before any tensor is built, naming the path, the key and the record, whether
    or not the file carries a (forged) seal."""
    path = tmp_path / "hostile.pt"
    _forge(path, storage_numel=numel, size=(numel,), stride=(1,), record=bytes(16))
    if sealed:
        _seal(path)
    like = {"w": torch.zeros(numel)}
    snap = snapshot(like)
    expected = (
        rf"^load_?: {re.escape(repr(str(path)))}: 'w' declares {numel} elements of "
        rf"torch\.float32 \({4 * numel} bytes\) in record 'archive/data/0', which holds 16 "
        rf"bytes; the file is corrupt or forged"
    )
    with pytest.raises(ValueError, match=expected):
        mpfunc.load(path, like=like, unverified=not sealed)
    with pytest.raises(ValueError, match=expected):
        mpfunc.load_(path, like, unverified=not sealed)
    assert_unchanged(like, snap)


def test_a_view_past_its_storage_is_refused(tmp_path: pathlib.Path, no_torch_load: None) -> None:
    """An honest 4-element storage, but a view of 2^16 elements (or a stride that walks
    past the end) over it."""
    path = tmp_path / "view.pt"
    _forge(path, storage_numel=4, size=(2**16,), stride=(1,), record=bytes(16))
    with pytest.raises(ValueError, match=r"'w' reaches 262144 bytes into its storage"):
        mpfunc.load(path, like={"w": torch.zeros(2**16)}, unverified=True)
    _forge(path, storage_numel=4, size=(2,), stride=(4,), record=bytes(16))
    with pytest.raises(ValueError, match=r"'w' reaches 20 bytes into its storage"):
        mpfunc.load(path, like={"w": torch.zeros(2)}, unverified=True)


def test_ambiguous_or_misplaced_records_are_refused(
    tmp_path: pathlib.Path, no_torch_load: None
) -> None:
    """torch finds records by name ignoring case, so two names differing in case make the
    sizes checked and the bytes read disagree; a record past the end is refused too."""
    path = tmp_path / "twice.pt"
    _forge(
        path,
        storage_numel=4,
        size=(4,),
        stride=(1,),
        record=bytes(16),
        names=("archive/data/0", "archive/DATA/0"),
    )
    with pytest.raises(ValueError, match=r"not a readable mpfunc checkpoint.*repeated record"):
        mpfunc.load(path, like={"w": torch.zeros(4)}, unverified=True)
    _forge(path, storage_numel=4, size=(4,), stride=(1,), record=bytes(16))
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")  # the central directory: find the record's entry
    while data[entry + 46 : entry + 60] != b"archive/data/0":
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 20 : entry + 28] = struct.pack("<II", 1 << 30, 1 << 30)  # sizes: 1 GiB
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"not a readable mpfunc checkpoint"):
        mpfunc.load(path, like={"w": torch.zeros(4)}, unverified=True)


def test_a_file_holding_objects_is_refused_before_unpickling(
    tmp_path: pathlib.Path, no_torch_load: None
) -> None:
    """Anything but a dict of dense tensors (a Parameter, a number, a nested dict) is
    refused by the scan, which only names globals and never imports or calls them."""
    path = tmp_path / "objects.pt"
    for payload in (
        {"w": torch.nn.Parameter(torch.zeros(2))},
        {"w": 3},
        {"w": {"x": torch.zeros(2)}},
        [torch.zeros(2)],
    ):
        torch.save(payload, path)
        with pytest.raises(ValueError, match=r"not a readable mpfunc checkpoint"):
            mpfunc.load(path, like={"w": torch.zeros(2)}, unverified=True)


def test_a_mismatched_file_is_refused_before_torch_load(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys, shapes and dtypes are compared with the tree from the file's pickle, so a
    file for another tree (a large one, say) allocates nothing."""
    path = tmp_path / "big.pt"
    mpfunc.save(path, {"w": torch.zeros(1000, 10)})
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(ValueError, match=r"'w': expected shape \(10,\), got \(1000, 10\)"):
        mpfunc.load(path, like={"w": torch.zeros(10)})
