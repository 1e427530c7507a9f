"""Checkpoint files on disk: temporary files, permissions, views, and errors that name
the user's path."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from support.helpers import assert_bits_equal

import mpfunc

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file semantics")

# A save that stops for good after writing part of its temporary file: a process to
# kill mid-save, deterministically.
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
def stuck_saver(tmp_path: pathlib.Path) -> Iterator[subprocess.Popen[str]]:
    """A process stopped in the middle of saving ``tmp_path / "ck.pt"``."""
    with subprocess.Popen(
        [sys.executable, "-c", _STUCK_SAVER, str(tmp_path / "ck.pt")],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
            yield proc
        finally:
            proc.kill()
            proc.wait(timeout=60)


def temps(folder: pathlib.Path, name: str = "ck.pt") -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != name)


def test_a_killed_save_leaves_a_findable_temp_that_the_next_save_removes(
    tmp_path: pathlib.Path, stuck_saver: subprocess.Popen[str]
) -> None:
    """SIGKILL mid-save leaves ``.ck.pt.mpfunc-tmp-<pid>-<random>``. A save made while that
    process still lives leaves its file alone (a concurrent save); once it is dead, the
    next save removes it, and the folder holds only the checkpoint."""
    path = tmp_path / "ck.pt"
    pid = stuck_saver.pid
    (left,) = temps(tmp_path)
    assert re.fullmatch(rf"\.ck\.pt\.mpfunc-tmp-{pid}-[0-9a-f]{{8}}", left), left
    mpfunc.save(path, {"w": torch.zeros(3)})  # the other save is alive: not touched
    assert temps(tmp_path) == [left]
    stuck_saver.send_signal(signal.SIGKILL)
    stuck_saver.wait(timeout=60)
    assert temps(tmp_path) == [left]  # a killed process cannot clean up
    (tmp_path / "other.pt.keep").write_bytes(b"")  # someone else's file: never touched
    mpfunc.save(path, {"w": torch.full((3,), 2.0)})
    assert temps(tmp_path) == ["other.pt.keep"]
    assert torch.equal(mpfunc.load(path, like={"w": torch.zeros(3)})["w"], torch.full((3,), 2.0))


def test_a_temp_in_use_by_this_process_is_left_alone(tmp_path: pathlib.Path) -> None:
    """A temporary file locked by a writer in this very process (another thread's save)
    is not removed; once unlocked, it is."""
    import fcntl

    path = tmp_path / "ck.pt"
    busy = tmp_path / f".ck.pt.mpfunc-tmp-{os.getpid()}-0123abcd"
    with open(busy, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        mpfunc.save(path, {"w": torch.zeros(1)})
        assert temps(tmp_path) == [busy.name]
    mpfunc.save(path, {"w": torch.zeros(1)})
    assert temps(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o027])
def test_permissions_follow_the_umask_as_torch_save(tmp_path: pathlib.Path, umask: int) -> None:
    """A new file gets 0o666 less the umask; a replaced file keeps its mode; both exactly
    what torch.save gives (mpfunc 0.1 wrote 0o600 always)."""
    tree = {"w": torch.zeros(2)}

    def mode(p: pathlib.Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    old = os.umask(umask)
    try:
        mpfunc.save(tmp_path / "new.pt", tree)
        torch.save(tree, tmp_path / "new-torch.pt")
        assert mode(tmp_path / "new.pt") == mode(tmp_path / "new-torch.pt") == 0o666 & ~umask
        for existing in (0o644, 0o600, 0o640):
            for name in ("old.pt", "old-torch.pt"):
                (tmp_path / name).write_bytes(b"")
                (tmp_path / name).chmod(existing)
            mpfunc.save(tmp_path / "old.pt", tree)
            torch.save(tree, tmp_path / "old-torch.pt")
            assert mode(tmp_path / "old.pt") == mode(tmp_path / "old-torch.pt") == existing
    finally:
        os.umask(old)


def test_a_slice_saves_only_its_own_elements(tmp_path: pathlib.Path) -> None:
    """A 4-element slice of a 10M-element tensor writes 16 bytes of data, not 40 MB; other
    layouts (transposed, expanded, conjugated) save their values."""
    big = torch.arange(10_000_000, dtype=torch.float32)
    path = tmp_path / "slice.pt"
    mpfunc.save(path, {"w": big[5:9]})
    assert path.stat().st_size < 4096
    assert torch.equal(mpfunc.load(path, like={"w": torch.zeros(4)})["w"], big[5:9])
    tree = {
        "t": torch.arange(6.0).reshape(2, 3).t(),
        "e": torch.tensor([1.5]).expand(5),
        "c": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "n": torch.tensor([1 + 2j]).conj().imag,  # a negative view
        "s": big[::2_000_000],
    }
    mpfunc.save(path, tree)
    like = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in tree.items()}
    back = mpfunc.load(path, like=like)
    for k, v in tree.items():
        assert torch.equal(back[k], v.resolve_conj().resolve_neg()), k
    assert path.stat().st_size < 8192


def test_a_missing_folder_error_names_the_users_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "no-such-folder" / "ck.pt"
    with pytest.raises(FileNotFoundError) as info:
        mpfunc.save(path, {"w": torch.zeros(1)})
    assert str(path) in str(info.value) and "does not exist" in str(info.value)
    assert "mpfunc-tmp" not in str(info.value) and ".tmp" not in str(info.value)
    # A folder where the file should be: the error names the path, and nothing is left.
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(IsADirectoryError) as info2:
        mpfunc.save(tmp_path / "dir.pt", {"w": torch.zeros(1)})
    assert str(tmp_path / "dir.pt") in str(info2.value) and "mpfunc-tmp" not in str(info2.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.pt"]


def test_a_users_file_named_like_a_temp_is_not_removed(tmp_path: pathlib.Path) -> None:
    # Found in review: any unlocked regular file with a temporary's name was removed. A
    # dead save leaves nothing or the start of torch's zip; anything else is kept.
    theirs = tmp_path / ".data.mpfunc-tmp-123-abcdef01"
    theirs.write_text("user data")
    dead = tmp_path / ".ck.pt.mpfunc-tmp-124-abcdef02"
    dead.write_bytes(b"PK\x03\x04partial")
    empty = tmp_path / ".ck.pt.mpfunc-tmp-125-abcdef03"
    empty.write_bytes(b"")
    mpfunc.save(tmp_path / "other.pt", {"w": torch.ones(2)})
    assert theirs.read_text() == "user data"
    assert not dead.exists() and not empty.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and SIGXFSZ: Linux")
def test_a_write_that_fails_midway_is_an_oserror_naming_the_path(tmp_path: pathlib.Path) -> None:
    # A full disk, here a file size limit: torch's zip writer reported the failed write as
    # "unexpected pos 832 vs 726" (found in review). The old file stays, no temp is left.
    script = textwrap.dedent(
        f"""
        import os, resource, signal, torch, mpfunc
        path = {str(tmp_path / "ck.pt")!r}
        mpfunc.save(path, {{"w": torch.ones(4)}})
        old = open(path, "rb").read()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        try:
            mpfunc.save(path, {{"w": torch.randn(1 << 20)}})
        except OSError as e:
            print(type(e).__name__, e.errno, e)
        assert open(path, "rb").read() == old
        print(sorted(os.listdir(os.path.dirname(path))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0].startswith("OSError 27 [Errno 27] save: cannot write ") and "ck.pt" in out[0], out
    assert "File too large" in out[0], out
    assert out[1] == "['ck.pt']", out


def test_leaves_without_plain_values_are_refused_before_writing(tmp_path: pathlib.Path) -> None:
    """Sparse, quantized and meta tensors have no plain bytes to save: a clear error naming
    the key, and no file."""
    path = tmp_path / "ck.pt"
    for leaf, got in (
        (torch.eye(3).to_sparse(), "sparse_coo tensor"),
        (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quint8|qint8"),
        (torch.zeros(2, device="meta"), "meta"),
    ):
        with pytest.raises(TypeError, match=rf"save: at 'w': expected .*, got .*({got})"):
            mpfunc.save(path, {"w": leaf, "ok": torch.zeros(1)})
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_is_replaced_not_written_through(tmp_path: pathlib.Path) -> None:
    """``path`` itself is replaced (atomic rename), as documented: a symlink there becomes
    the checkpoint, and its old target is untouched."""
    target = tmp_path / "step100.pt"
    mpfunc.save(target, {"w": torch.zeros(2)})
    before = target.read_bytes()
    link = tmp_path / "latest.pt"
    link.symlink_to(target.name)
    mpfunc.save(link, {"w": torch.ones(2)})
    assert not link.is_symlink() and target.read_bytes() == before
    assert_bits_equal(mpfunc.load(link, like={"w": torch.zeros(2)})["w"], torch.ones(2))
