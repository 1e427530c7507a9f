"""Checkpoint files at the user's edge: temps left by killed saves are removed, forged
files are refused, paths that name a folder and file objects are refused before
anything is written, bytes paths are accepted."""

from __future__ import annotations

import io
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mpfunc

posix = pytest.mark.skipif(os.name != "posix", reason="POSIX file semantics")


# A save of argv[1] that stops for good after writing part of its temporary file: a
# process to kill mid-save (or to keep alive), deterministically.
_STUCK_SAVER = textwrap.dedent(
    """
    import sys, time, torch, mpfunc

    def stuck(obj, f, *args, **kwargs):
        f.write(b"PK\\x03\\x04" + b"x" * 4092)  # the start of a zip, as torch writes it
        f.flush()
        print("writing", flush=True)
        time.sleep(600)

    torch.save = stuck
    mpfunc.save(sys.argv[1], {"w": torch.ones(3)})
    """
)


@pytest.fixture
def stuck_saves(tmp_path: pathlib.Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Two processes stopped in the middle of saving ``ckpt-100.pt`` and ``ckpt-150.pt``."""
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name in ("ckpt-100.pt", "ckpt-150.pt"):
            proc = subprocess.Popen(
                [sys.executable, "-c", _STUCK_SAVER, str(tmp_path / name)],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs[name] = proc
            assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=60)
            if proc.stdout is not None:
                proc.stdout.close()


@posix
def test_a_save_removes_temps_that_dead_saves_of_other_checkpoints_left(
    tmp_path: pathlib.Path, stuck_saves: dict[str, subprocess.Popen[str]]
) -> None:
    """Issue 20, item 7: a job killed in ``save("ckpt-100.pt")`` leaves its temporary file;
    the restarted job's ``save("ckpt-200.pt")`` removes it. A live save's temporary file
    (``ckpt-150.pt``, still being written) and files mpfunc did not make (look-alike
    names, a folder and a symlink with a temporary file's name) are left alone."""
    dead, alive = stuck_saves["ckpt-100.pt"], stuck_saves["ckpt-150.pt"]
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=60)
    names = sorted(p.name for p in tmp_path.iterdir())
    (dead_temp,) = [n for n in names if n.startswith(".ckpt-100.pt.")]
    (live_temp,) = [n for n in names if n.startswith(".ckpt-150.pt.")]
    assert re.fullmatch(rf"\.ckpt-100\.pt\.mpfunc-tmp-{dead.pid}-[0-9a-f]{{8}}", dead_temp)
    assert re.fullmatch(rf"\.ckpt-150\.pt\.mpfunc-tmp-{alive.pid}-[0-9a-f]{{8}}", live_temp)
    others = ["ckpt-100.pt.tmp", ".ckpt-100.pt.mpfunc-tmp-notes", "notes.mpfunc-tmp-1-0123abcd"]
    for name in others:
        (tmp_path / name).write_bytes(b"mine")
    (tmp_path / ".dir.mpfunc-tmp-1-0123abcd").mkdir()
    (tmp_path / ".link.mpfunc-tmp-1-0123abcd").symlink_to(tmp_path / "ckpt-100.pt.tmp")
    others += [".dir.mpfunc-tmp-1-0123abcd", ".link.mpfunc-tmp-1-0123abcd"]

    mpfunc.save(tmp_path / "ckpt-200.pt", {"w": torch.full((3,), 2.0)})

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt-200.pt", live_temp, *others])
    assert (tmp_path / "ckpt-100.pt.tmp").read_bytes() == b"mine"
    back = mpfunc.load(tmp_path / "ckpt-200.pt", like={"w": torch.zeros(3)})
    assert torch.equal(back["w"], torch.full((3,), 2.0))
    alive.kill()  # once its writer is gone, the live save's file goes too
    alive.wait(timeout=60)
    mpfunc.save(tmp_path / "ckpt-300.pt", {"w": torch.zeros(3)})
    assert live_temp not in {p.name for p in tmp_path.iterdir()}


_SEAL = b"mpfunc-checkpoint v1 crc32="


def _reseal(data: bytearray) -> bytes:
    """``data`` (a file from ``save`` whose seal was cut off, comment length 0) with the
    seal ``save`` writes: a forger can compute it (the format is in checkpoint/_file.py)."""
    assert data[-22:-18] == b"PK\x05\x06" and data[-2:] == b"\0\0"
    seal = _SEAL + b"%08x" % zlib.crc32(bytes(data))
    return bytes(data[:-2] + struct.pack("<H", len(seal)) + seal)


def _forge_zip_version(good: bytes, version: int) -> bytes:
    """``good`` with the first central-directory record's "version needed to extract" set
    to ``version`` (zipfile reads up to 63, i.e. 6.3), resealed."""
    data = bytearray(good[: -len(_SEAL) - 8])
    data[-2:] = b"\0\0"
    eocd = len(data) - 22
    (directory,) = struct.unpack("<I", data[eocd + 16 : eocd + 20])
    assert data[directory : directory + 4] == b"PK\x01\x02"
    data[directory + 6 : directory + 8] = struct.pack("<H", version)
    return _reseal(data)


@pytest.mark.parametrize("load", [mpfunc.load, mpfunc.load_], ids=["load", "load_"])
def test_a_forged_zip_version_with_a_valid_seal_is_a_value_error(
    tmp_path: pathlib.Path, load: Any
) -> None:
    """Issue 20, item 9: a sealed file whose zip directory asks for zip version 9.9 made
    zipfile raise NotImplementedError out of ``load``; it is the documented ValueError,
    naming the file and what is wrong, and the tree is untouched."""
    tree = {"w": torch.arange(3.0)}
    good = tmp_path / "good.pt"
    mpfunc.save(good, tree)
    bad = tmp_path / "forged.pt"
    bad.write_bytes(_forge_zip_version(good.read_bytes(), 99))
    like = {"w": torch.zeros(3)}
    name = load.__name__
    where = re.escape(repr(str(bad)))
    message = rf"{name}: {where} is not a readable mpfunc checkpoint.*zip file version 9\.9"
    with pytest.raises(ValueError, match=message):
        load(bad, like)
    assert torch.equal(like["w"], torch.zeros(3))
    assert torch.equal(load(good, like)["w"], tree["w"])  # the forgery is what failed


@pytest.mark.parametrize("path", ["c.pt/", "c.pt//", "c.pt/.", "sub/..", ".", ""])
def test_a_path_naming_a_folder_is_refused_before_anything_is_written(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Issue 20, item 9: ``save(tree, "c.pt/")`` silently wrote ``c.pt`` (``abspath`` drops
    the separator). A path whose last part is empty, ``.`` or ``..`` names a folder: a
    ValueError naming the path, before any file is created or replaced; ``load`` and
    ``load_`` say the same."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "c.pt").write_bytes(b"previous")
    before = sorted(p.name for p in tmp_path.iterdir())
    tree = {"w": torch.ones(2)}
    shown = re.escape(repr(path)) if path else "an empty path"
    for fn in (mpfunc.save, mpfunc.load, mpfunc.load_):
        with pytest.raises(
            ValueError, match=rf"{fn.__name__}: path: expected the path of a file, got {shown}"
        ):
            fn(path, tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "c.pt").read_bytes() == b"previous"
    assert torch.equal(tree["w"], torch.ones(2))
    if path.endswith("/"):
        with pytest.raises(ValueError, match=r"did you mean 'c\.pt'\?"):
            mpfunc.save(path, tree)


@posix
def test_bytes_paths_are_accepted(tmp_path: pathlib.Path) -> None:
    """Issue 20, item 9: a bytes path (what ``os.listdir(b".")`` gives, any bytes the file
    system allows) made ``save`` fail with "Can't mix strings and bytes in path
    components". ``save``, ``load`` and ``load_`` take ``str``, ``bytes`` and
    ``os.PathLike`` alike."""
    tree = {"w": torch.arange(4.0)}
    path = os.fsencode(tmp_path) + b"/ck-\xff.pt"  # not valid UTF-8: decoded losslessly
    mpfunc.save(path, tree)
    assert os.listdir(os.fsencode(tmp_path)) == [b"ck-\xff.pt"]
    assert torch.equal(mpfunc.load(path, {"w": torch.zeros(4)})["w"], tree["w"])
    into = {"w": torch.zeros(4)}
    mpfunc.load_(path, into)
    assert torch.equal(into["w"], tree["w"])
    assert torch.equal(mpfunc.load(tmp_path / os.fsdecode(b"ck-\xff.pt"), into)["w"], tree["w"])


@pytest.mark.parametrize("kind", ["BytesIO", "open file"])
def test_file_objects_are_refused_with_what_is_accepted(tmp_path: pathlib.Path, kind: str) -> None:
    """Issue 20, item 9: a file object (what ``torch.save`` also takes) gave os.fspath's
    bare TypeError. It stays refused, since a save is atomic through a temporary file
    beside the target and a load verifies the file before torch reads it, with a
    TypeError that names the function and what is accepted, before anything is written."""
    tree = {"w": torch.ones(2)}
    accepted = r"path: expected a str, bytes or os.PathLike naming a file, got "
    with io.BytesIO() if kind == "BytesIO" else (tmp_path / "f.pt").open("w+b") as f:
        for fn in (mpfunc.save, mpfunc.load, mpfunc.load_):
            with pytest.raises(
                TypeError, match=rf"{fn.__name__}: {accepted}.*pass the file's path"
            ):
                fn(f, tree)
        f.seek(0, io.SEEK_END)
        assert f.tell() == 0  # nothing written into it
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if kind == "BytesIO" else ["f.pt"])
