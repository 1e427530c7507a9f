"""Checkpoint files: atomic, checksummed, code-free ``save``/``load`` in torch's own format.
The state dicts they hold, and the manifest of their checksums, are ``_state_dict``'s; the
scanner that reads a file before ``torch.load`` does is ``_scanner``.

A file from ``save`` is what ``torch.save`` writes for that dict, plus two checks:

* **a manifest**, one more entry under the reserved key ``"__mpfunc_manifest__"``:
  a uint8 tensor of JSON holding the CRC-32 of every tensor (its key, dtype, shape
  and bytes). ``load`` recomputes them on the loaded values, and so does
  ``load_state_dict`` when handed a raw ``torch.load`` of the file.
* **a seal**, the zip archive's comment ``mpfunc-checkpoint v1 crc32=<8 hex digits>``:
  the CRC-32 of every byte before it, as ``torch.save`` wrote them (comment length 0).
  A CRC-32 catches every error confined to 32 consecutive bits, so any single
  corrupted byte anywhere in the file is an error, never a wrong value.

Before ``torch.load`` sees a file, its zip directory and pickle are read without
building or running anything, and every storage it declares is checked against the
bytes its record really holds: ``torch.load`` itself trusts the declared size and reads
past the record (heap memory, or a crash).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import stat
import struct
import threading
import zlib
from collections.abc import Mapping
from typing import IO, Any, Union, cast

import torch

from mpfunc.checkpoint._scanner import _scan, _unreadable
from mpfunc.checkpoint._state_dict import (
    MANIFEST_KEY,
    _check_sd,
    _check_values,
    _fresh,
    _host_bytes,
    _keyed_leaves,
    _kind_problem,
    _manifest,
    _problems,
    _raise_problems,
    _verify_manifest,
    _write_into,
    state_dict,
)
from mpfunc.core import _checks
from mpfunc.strategies import _remainder

try:  # advisory locks mark a temporary file as in use; POSIX only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


__all__ = ["load", "load_", "save"]


# A file path as ``open`` takes it; file objects are refused (see ``_path``).
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


_SEAL_PREFIX = b"mpfunc-checkpoint v1 crc32="


_SEAL_LEN = len(_SEAL_PREFIX) + 8


_EOCD = b"PK\x05\x06"  # zip end-of-central-directory record: 22 bytes + comment


_EOCD_LEN = 22


_CHUNK = 1 << 22


_TMP_TAG = ".mpfunc-tmp-"


_NAME_MAX = 255  # bytes in one file name on every common file system


_PID_DIGITS = 10


class _CrcWriter:
    """A write-only file that computes the CRC-32 of everything written through it and
    keeps the last bytes (the zip's end record, to seal it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.crc = 0
        self.size = 0
        self.tail = b""
        # The first OSError of a write or flush (a full disk, a file size limit): torch's
        # zip writer turns it into "unexpected pos" RuntimeErrors, so save() says it.
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        self.tail = (self.tail + bytes(view[-_EOCD_LEN:]))[-_EOCD_LEN:]
        try:
            return self.f.write(view)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def _seal(f: IO[bytes], w: _CrcWriter) -> None:
    """Appends the seal as the zip archive's comment (torch writes none)."""
    if w.size < _EOCD_LEN or w.tail[:4] != _EOCD or w.tail[20:] != b"\0\0":
        raise RuntimeError("save: torch.save did not end the file with a plain zip end record")
    f.seek(w.size - 2)
    f.write(struct.pack("<H", _SEAL_LEN))
    f.seek(w.size)
    f.write(_SEAL_PREFIX + b"%08x" % w.crc)


def _crc_of(f: io.BufferedReader, start: int, stop: int, crc: int = 0) -> int:
    f.seek(start)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    left = stop - start
    while left > 0:
        n = f.readinto(view[: min(left, _CHUNK)])
        if not n:
            raise ValueError("the file shrank while it was read")
        crc = zlib.crc32(view[:n], crc)
        left -= n
    return crc


def _check_seal(fn: str, path: str, f: io.BufferedReader, size: int) -> bool:
    """Whether the file carries a seal; raises if it does and the seal does not match."""
    if size < _EOCD_LEN + _SEAL_LEN:
        return False
    f.seek(size - _SEAL_LEN)
    tail = f.read(_SEAL_LEN)
    if not tail.startswith(_SEAL_PREFIX):
        return False
    eocd_at = size - _SEAL_LEN - _EOCD_LEN
    f.seek(eocd_at)
    eocd = f.read(_EOCD_LEN)
    digits = tail[len(_SEAL_PREFIX) :]
    # The comment length must be the seal's, and the CRC is of the file as torch wrote
    # it: the end record with a comment length of 0.
    ok = (
        eocd[:4] == _EOCD
        and eocd[20:] == struct.pack("<H", _SEAL_LEN)
        and re.fullmatch(rb"[0-9a-f]{8}", digits) is not None
        and zlib.crc32(b"\0\0", _crc_of(f, 0, eocd_at + 20)) == int(digits, 16)
    )
    if not ok:
        raise ValueError(
            f"{fn}: {path!r} is corrupt: its bytes do not match the checksum save wrote "
            f"(at least one byte changed since); nothing was loaded"
        )
    return True


def _path(fn: str, path: object) -> str:
    """The user's path as a ``str``, checked before anything is read or written.

    ``str``, ``bytes`` and ``os.PathLike`` (of either) are accepted, bytes decoded as the
    ``os`` functions decode them (``os.fsdecode``, lossless). A file object is refused:
    ``save`` writes a temporary file beside its target and renames it into place, and
    ``load`` verifies the file before ``torch.load`` reads it, neither of which a stream
    allows. A path whose last part is empty, ``.`` or ``..`` names a folder, not a file:
    refused, where ``os.path.abspath`` would quietly turn ``"c.pt/"`` into ``"c.pt"``.
    """
    try:
        where: str = os.fsdecode(cast(Any, path))  # os.fspath, then bytes decoded
    except TypeError:
        why = (
            "it writes a temporary file beside the checkpoint and renames it into place"
            if fn == "save"
            else "it verifies the whole file before torch.load reads it"
        )
        raise TypeError(
            f"{fn}: path: expected a str, bytes or os.PathLike naming a file, got "
            f"{_checks.describe(path)}. File objects (open(...), io.BytesIO) are not "
            f"accepted, because {why}: pass the file's path"
        ) from None
    seps = os.sep + (os.altsep or "")
    if not _path_names_file(where):
        last = os.path.basename(where)
        if not where:
            why = "an empty path"
        elif where[-1] in seps:
            name = where.rstrip(seps)
            hint = f"; did you mean {name!r}?" if _path_names_file(name) else ""
            why = f"{where!r}, which ends in a path separator, so it names a folder{hint}"
        else:
            why = f"{where!r}, which ends in {last!r}, so it names a folder"
        raise ValueError(
            f"{fn}: path: expected the path of a file, got {why} (nothing was read or written)"
        )
    return where


def _path_names_file(where: str) -> bool:
    return os.path.basename(where) not in ("", ".", "..")


def _read(
    fn: str, where: str, wanted: Mapping[str, torch.Tensor], unverified: bool
) -> tuple[str, dict[str, torch.Tensor]]:
    """Every check of a file, then ``torch.load``: the seal, the zip and pickle scan (sizes,
    kinds), the keys, shapes and dtypes against ``wanted``, and after loading the manifest.
    ``where`` is the user's path from ``_path``. Returns it and the state dict without its
    manifest."""
    try:
        f = open(where, "rb")  # noqa: SIM115 - closed below, after torch.load
    except FileNotFoundError:
        raise FileNotFoundError(f"{fn}: {where!r} does not exist") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        sealed = _check_seal(fn, where, f, size)
        metas = _scan(fn, where, f, size)
        if not sealed and not unverified:
            raise ValueError(
                f"{fn}: {where!r} has no mpfunc checksum (written by mpfunc 0.1, by torch.save, "
                f"or its checksum is damaged), so a corrupted byte in it could not be "
                f"detected. Re-save it with mpfunc.save, or pass unverified=True to load it "
                f"without the file checksum (sizes, keys, shapes and dtypes are still checked)"
            )
        if sealed and MANIFEST_KEY not in metas:
            raise ValueError(f"{fn}: {where!r} is corrupt: sealed, but it has no manifest")
        metas.pop(MANIFEST_KEY, None)
        untied = _untied_units(wanted, metas)
        expected = {k: t for k, t in wanted.items() if k not in untied}
        _raise_problems(fn, repr(where), _problems(expected, metas))
        f.seek(0)
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types here: say what it means
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"{_unreadable(fn, where)}: {type(e).__name__}: {first}") from e
    if not isinstance(sd, dict):
        raise ValueError(
            f"{fn}: {where!r}: expected a dict of str to tensors, got {type(sd).__name__}"
        )
    if untied:
        # Every checksum is verified before anything is derived from the values.
        sd = dict(_verify_manifest(fn, repr(where), _check_file_sd(fn, where, sd)))
        for ties_key, (param_key, remainder_key) in untied.items():
            master = _remainder.join_ties_away(sd[param_key], sd[remainder_key])
            sd[param_key], sd[remainder_key], sd[ties_key] = _remainder.split(master)
    return where, sd


_TIES = ".ties"


def _untied_units(
    wanted: Mapping[str, torch.Tensor], metas: Mapping[str, Any]
) -> dict[str, tuple[str, str]]:
    """The ``"remainder"`` units the file holds in the encoding from before tie bits: a
    ``param`` and a ``remainder`` (ties rounded away from zero) and no ``ties``. Each is
    read by that rule and split again by today's (``{ties key: (param key, remainder
    key)}``), so files written before tie bits still load, bit-exact in their masters."""
    out: dict[str, tuple[str, str]] = {}
    for k, t in wanted.items():
        if not k.endswith(_TIES) or k in metas or t.dtype != _remainder.TIE_DTYPE:
            continue
        base = k[: -len(_TIES)]
        pk, rk = base + ".param", base + ".remainder"
        p, r = wanted.get(pk), wanted.get(rk)
        if p is None or r is None or pk not in metas or rk not in metas:
            continue
        if p.dtype != torch.bfloat16 or r.dtype != torch.int16:
            continue
        if tuple(t.shape) != _remainder.tie_shape(p.shape) or r.shape != p.shape:
            continue
        out[k] = (pk, rk)
    return out


def load(path: PathLike, like: Any, *, unverified: bool = False) -> Any:
    """Loads a checkpoint written by ``save`` into a new tree shaped like ``like``.

    Before ``torch.load`` runs, the file's checksum is verified and its zip directory
    and pickle are read without running anything: every storage must fit in the bytes
    its record holds, every value must be a dense tensor, and the keys, shapes and
    dtypes must match ``like`` (all problems listed in one error). The file is then
    read with ``torch.load(weights_only=True)``, so no code in it ever runs, and every
    tensor is checked against its own checksum. Values are restored to ``like``'s
    devices (XLA included), never converted to another dtype. ``like`` is not
    modified: to resume a run, use ``load_``, which writes into the run's own tensors.

    Args:
      path: a file written by ``save``: a ``str``, ``bytes`` or ``os.PathLike`` (not a
        file object).
      like: a tree of the wanted structure (e.g. freshly initialized masters and state).
      unverified: also accept a file without mpfunc's checksum: one written by mpfunc
        0.1 (before checksums) or a plain ``torch.save`` of a state dict. Sizes, kinds,
        keys, shapes and dtypes are still checked, and a manifest that is present is
        still verified; only a corrupted byte could go unnoticed.

    Returns:
      A tree of ``like``'s structure with fresh tensors.

    Raises:
      ValueError: the file is not a readable checkpoint (truncated, random bytes, or
        holding objects other than tensors), is corrupt (a checksum does not match),
        declares more data than it holds, has no checksum (unless ``unverified``), or
        belongs to another tree (every missing/unexpected key and shape/dtype mismatch
        is listed). The message names ``path``. Also when ``path`` ends in a separator,
        ``.`` or ``..`` (it names a folder).
      TypeError: ``path`` is not a ``str``, ``bytes`` or ``os.PathLike`` (a file object).
      FileNotFoundError: ``path`` does not exist.
    """
    fn = "load"
    where = _path(fn, path)
    keys, leaves, spec = _keyed_leaves(fn, like)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    where, sd = _read(fn, where, wanted, unverified)
    sd = _check_values(fn, repr(where), keys, leaves, _check_file_sd(fn, where, sd), tree=like)
    return _fresh(keys, leaves, spec, sd)


def load_(path: PathLike, tree: Any, *, unverified: bool = False) -> Any:
    """Loads a checkpoint written by ``save`` into ``tree``'s own tensors: the in-place
    twin of ``load``, and the way to resume a run.

    The file gets every check of ``load``, and the tree every check of
    ``load_state_dict_``, before the first write. Every tensor object stays the same,
    so an optimizer built with ``lr=lr_tensor`` reads the restored lr, and the model's
    params, if in the tree, are restored where the model holds them::

      ckpt = {"masters": masters, "opt": state, "lr": lr, "params": params}
      mpfunc.save("run.pt", ckpt)
      ...                                     # a fresh process builds the same objects
      mpfunc.load_("run.pt", ckpt)            # then trains on, bit-identical

    A loss scale is an immutable value whose tensors are restored in place too.

    Args:
      path: a file written by ``save``, as in ``load``.
      tree: the tree to restore, written in place.
      unverified: as in ``load``.

    Returns:
      ``tree``, for chaining.

    Raises:
      TypeError, ValueError, FileNotFoundError: as ``load``, and as ``load_state_dict_``
        for a leaf that cannot be written in place. Nothing is written unless every check
        passes.
    """
    fn = "load_"
    where = _path(fn, path)
    keys, leaves, _ = _keyed_leaves(fn, tree)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    where, sd = _read(fn, where, wanted, unverified)
    sd = _check_values(
        fn, repr(where), keys, leaves, _check_file_sd(fn, where, sd), in_place=True, tree=tree
    )
    _write_into(fn, keys, leaves, sd)
    return tree


def _check_file_sd(fn: str, where: str, sd: dict[Any, Any]) -> dict[str, torch.Tensor]:
    """A loaded file's dict, checked like an ``sd`` argument, as a ``ValueError``: the file
    is at fault, not the caller."""
    try:
        return _check_sd(fn, sd)
    except TypeError as e:
        raise ValueError(f"{fn}: {where!r}: {str(e).removeprefix(fn + ': sd: ')}") from None


_ACTIVE: set[str] = set()  # this process's temporary files, being written


_ACTIVE_LOCK = threading.Lock()


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)  # POSIX only


def _temp_prefix(base: str) -> str:
    """``.<base>.mpfunc-tmp-``, ``base`` shortened so that a full name fits in 255 bytes."""
    room = _NAME_MAX - len(os.fsencode(f"..{_TMP_TAG}")) - _PID_DIGITS - 1 - 8
    while len(os.fsencode(base)) > room:
        base = base[:-1]
    return f".{base}.{_TMP_TAG[1:]}"


# Every temporary file ``_create_temp`` names, whatever checkpoint it was for.
_TEMP_NAME = re.compile(
    rf"\..+{re.escape(_TMP_TAG)}[0-9]{{1,{_PID_DIGITS}}}-[0-9a-f]{{8}}\Z", re.DOTALL
)


def _remove_stale(folder: str) -> None:
    """Removes the temporary files that saves into ``folder`` left behind when their
    writer died (a job killed mid-save), whatever checkpoint they were for: a killed
    ``save("ckpt-100.pt")`` is cleaned up by the next ``save("ckpt-200.pt")``.

    Only names ``_create_temp`` makes (``.<name>.mpfunc-tmp-<pid>-<8 hex digits>``) that
    are regular files, empty or starting as torch's zip does, are candidates. Each writer
    holds an exclusive ``flock`` on its temporary file until the file has been renamed into
    place, and the kernel drops the
    lock when the writer dies (even by SIGKILL). A temporary file whose lock can be
    taken therefore has no live writer, whatever its pid says: pids are reused (a
    restarted job in a container often gets the dead one's pid back) and mean nothing
    across containers or hosts, so ``os.kill(pid, 0)`` would both keep dead files and
    misjudge other hosts' writers. One still locked belongs to a concurrent save and is
    left alone; so are this process's own saves in flight (``_ACTIVE``), and everything
    on a file system without locks.
    """
    if fcntl is None:
        return
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if _TEMP_NAME.match(e.name)]
    except OSError:
        return
    for name in names:
        tmp = os.path.join(folder, name)
        with _ACTIVE_LOCK:
            if tmp in _ACTIVE:  # another thread's save
                continue
        try:  # O_NOFOLLOW: a symlink is not ours; O_NONBLOCK: a FIFO must not block
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | _O_CLOEXEC
            fd = os.open(tmp, flags)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            # What a save leaves: nothing yet, or the start of torch's zip. A file of that
            # name holding anything else is not ours (found in review: a user's file
            # named like a temporary was removed).
            if os.read(fd, 4) not in (b"", b"PK\x03\x04"):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.lstat(tmp), st):  # still the file we locked
                os.unlink(tmp)
        except OSError:
            pass  # locked: a live save owns it; or it went away meanwhile
        finally:
            os.close(fd)


def _create_temp(fn: str, where: str, folder: str, base: str) -> tuple[int, str]:
    """Creates and locks ``.<base>.mpfunc-tmp-<pid>-<random>`` in ``folder``, with the
    permissions ``open()`` would give (0o666 less the umask), as ``torch.save`` does."""
    prefix = _temp_prefix(base)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(folder, f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")
        with _ACTIVE_LOCK:
            _ACTIVE.add(tmp)
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            _forget(tmp)
            continue
        except OSError as e:
            _forget(tmp)
            raise _user_error(fn, where, folder, e) from None
        if fcntl is None:
            return fd, tmp
        # Lock, then make sure no cleaner removed the file between open and lock (it
        # could take the lock in that instant); if one did, start over.
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: no cleaner can take it either
            return fd, tmp
        try:
            if os.path.samestat(os.lstat(tmp), os.fstat(fd)):
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)
        _forget(tmp)
    raise FileExistsError(f"{fn}: could not create a temporary file in {folder!r} for {where!r}")


def _forget(tmp: str) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(tmp)


def _user_error(fn: str, where: str, folder: str, e: OSError) -> OSError:
    """The same kind of ``OSError``, naming the user's path instead of a temporary file."""
    if isinstance(e, FileNotFoundError) and not os.path.isdir(folder):
        reason = f"its folder {folder!r} does not exist"
    else:
        reason = f"{e.strerror or e} (in its folder {folder!r})"
    message = f"{fn}: cannot write {where!r}: {reason}"
    return type(e)(message) if e.errno is None else type(e)(e.errno, message)


def save(path: PathLike, tree: Any) -> None:
    """Saves ``tree``'s state dict to ``path`` atomically, in torch's own format,
    with a checksum for every tensor and one for the whole file.

    Tensors are copied to the host first (XLA and CUDA tensors included), each with
    only its own elements: a view of a larger tensor writes the view, not the
    storage behind it. The file is written to ``.<name>.mpfunc-tmp-<pid>-<random>``
    in the same folder, flushed and fsynced, then renamed over ``path``, so a crash
    mid-save never destroys the previous checkpoint. Temporary files that earlier
    saves into the same folder left behind (a process killed mid-save, whichever
    checkpoint it was writing) are removed, unless a live save is still writing them;
    no other file is touched. The file gets the permissions ``torch.save``
    would give it: those of the file it replaces, else 0o666 less the umask.
    ``path`` itself is replaced: a symlink there becomes the file. (mpfunc 0.1
    cannot load these files: it reports the manifest as an unexpected key.)

    Args:
      path: the checkpoint file to write: a ``str``, ``bytes`` or ``os.PathLike`` (not a
        file object, which cannot be written atomically).
      tree: any mpfunc tree (masters, optimizer state, loss scale, lr tensor, params).

    Raises:
      TypeError, ValueError: as ``state_dict``, or a leaf is not a dense tensor with
        data (sparse, quantized, meta or a tensor subclass); nothing is written then.
      TypeError: ``path`` is not a ``str``, ``bytes`` or ``os.PathLike`` (a file object).
      ValueError: ``path`` ends in a separator, ``.`` or ``..`` (``"c.pt/"`` names a
        folder, not the file ``"c.pt"``); nothing is written.
      OSError: the folder is missing or not writable (the error names ``path``; the
        previous file, if any, is intact).
    """
    fn = "save"
    where = _path(fn, path)
    sd = state_dict(tree)
    for k, v in sd.items():
        why = _kind_problem(v, plain=True)
        if why is not None:
            _checks.fail(TypeError, fn, k, *why)
        why = _checks.storage_problem(v)
        if why is not None:
            _checks.fail(ValueError, fn, k, *why, _checks.FREED_HINT)
    host = {k: _host_bytes(v) for k, v in sd.items()}
    host[MANIFEST_KEY] = _manifest(host)
    target = os.path.abspath(where)
    folder, base = os.path.split(target)
    _remove_stale(folder)
    fd, tmp = _create_temp(fn, where, folder, base)
    try:
        _keep_mode(fd, target)
        with os.fdopen(fd, "wb") as f:
            w = _CrcWriter(f)
            try:
                torch.save(host, cast(IO[bytes], w))  # torch only calls write and flush
            except RuntimeError as e:  # torch's report of a failed write: the write's own
                if w.error is None:
                    raise
                raise _user_error(fn, where, folder, w.error) from e
            _seal(f, w)
            f.flush()
            os.fsync(f.fileno())
            if fcntl is not None:  # rename while still locked, so no cleaner takes it
                _replace(fn, where, folder, tmp, target)
        if fcntl is None:  # pragma: no cover - Windows cannot rename an open file
            _replace(fn, where, folder, tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        _forget(tmp)
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _keep_mode(fd: int, target: str) -> None:
    """Gives the new file the permission bits of the file it replaces, as writing into it
    with ``torch.save`` would keep them."""
    try:
        st = os.stat(target)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and hasattr(os, "fchmod"):
        with contextlib.suppress(OSError):  # file systems without modes (FAT, some FUSE)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)


def _replace(fn: str, where: str, folder: str, tmp: str, target: str) -> None:
    try:
        os.replace(tmp, target)
    except OSError as e:
        raise _user_error(fn, where, folder, e) from None
