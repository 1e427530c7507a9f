"""Trust at the user's edge (issue 20): files left by killed saves, paths and files that
are not what ``save``/``load`` take, and a functional optimizer used as a torch.optim one.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

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
        f.write(b"x" * 4096)
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
