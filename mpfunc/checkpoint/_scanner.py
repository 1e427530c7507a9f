"""Reading a checkpoint file without trusting it: its zip directory and pickle are read
without building or running anything, and every storage it declares is checked against
the bytes its record really holds (``torch.load`` itself trusts the declared size and
reads past the record: heap memory, or a crash). Used by ``_file.load`` before
``torch.load`` sees the file.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

from mpfunc.checkpoint._state_dict import _Meta
from mpfunc.core import _checks

__all__ = []


_LOCAL_HEADER = b"PK\x03\x04"


_REBUILDERS = ("_rebuild_tensor_v2", "_rebuild_tensor_v3")


class _Global:
    """A global the pickle names: never imported, only recorded."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> _Call:
        return _Call(self, args)


class _Call:
    """A call the pickle asks for, recorded and never made."""

    def __init__(self, fn: _Global, args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args

    # What pickle may do to the result of a call (BUILD, SETITEMS, APPENDS): ignored.
    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StorageRef:
    """One storage the pickle declares, ``('storage', type, key, location, numel)``, with
    the size of the record that holds its bytes."""

    def __init__(self, dtype: torch.dtype, record: str, numel: int, held: int) -> None:
        self.dtype = dtype
        self.record = record
        self.numel = numel
        self.nbytes = numel * dtype.itemsize
        self.held = held


class _Unreadable(Exception):
    """The file is not what torch.save writes for a dict of tensors."""


def _torch_dtype(g: object) -> torch.dtype | None:
    """``torch.float8_e4m3fn`` named in a pickle, as a dtype, or ``None``."""
    if not isinstance(g, _Global) or g.module != "torch":
        return None
    dtype = getattr(torch, g.name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


# The storage classes torch.save names, by element type. The set is closed: newer dtypes
# are saved as a byte storage plus a dtype (``_rebuild_tensor_v3``).
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "QInt8Storage": torch.qint8,
    "QInt32Storage": torch.qint32,
    "QUInt8Storage": torch.quint8,
    "QUInt4x2Storage": torch.quint4x2,
    "QUInt2x4Storage": torch.quint2x4,
}


def _storage_dtype(g: object) -> torch.dtype | None:
    """The element type of a storage class named in a pickle (``torch.FloatStorage``:
    float32; ``torch.UntypedStorage``: bytes), or ``None``."""
    if not isinstance(g, _Global):
        return None
    if g.module in ("torch", "torch.storage") and g.name == "UntypedStorage":
        return torch.uint8
    return _LEGACY_STORAGES.get(g.name) if g.module == "torch" else None


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


class _Scanner(pickle.Unpickler):
    """Reads torch's ``data.pkl`` without importing or calling anything: globals become
    names, calls become records, and each storage becomes a ``_StorageRef``."""

    def __init__(self, data: bytes, records: Mapping[str, int], prefix: str) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.records = records
        self.prefix = prefix
        self.storages: list[_StorageRef] = []

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        return _Global(module_name, global_name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise _Unreadable(f"unexpected persistent id {pid!r:.80}")
        kind, storage_type, key, _location, numel = pid
        if isinstance(kind, bytes):
            kind = kind.decode("ascii", "replace")
        dtype = _storage_dtype(storage_type)
        if kind != "storage" or dtype is None or not isinstance(key, str) or not _is_count(numel):
            raise _Unreadable(f"unexpected persistent id {pid!r:.80}")
        record = f"{self.prefix}data/{key}"
        held = self.records.get(record.lower())
        if held is None:
            raise _Unreadable(f"no record {record!r} for a storage")
        ref = _StorageRef(dtype, record, numel, held)
        self.storages.append(ref)
        return ref


def _tensor_meta(value: object) -> tuple[_Meta, _StorageRef, int]:
    """The shape and dtype of a pickled tensor, its storage, and how many bytes of the
    storage its view reaches. Raises ``_Unreadable`` for anything but a dense tensor
    (``torch._utils._rebuild_tensor_v2``/``v3`` of a storage)."""
    if not (
        isinstance(value, _Call)
        and value.fn.module == "torch._utils"
        and value.fn.name in _REBUILDERS
        and len(value.args) >= 6
    ):
        what = f"a call of {value.fn.module}.{value.fn.name}" if isinstance(value, _Call) else None
        raise _Unreadable(f"expected a tensor, found {what or _checks.describe(value)}")
    storage, offset, size, stride = value.args[:4]
    dtype = storage.dtype if isinstance(storage, _StorageRef) else None
    if value.fn.name == "_rebuild_tensor_v3":  # new dtypes: a byte storage and a dtype
        dtype = _torch_dtype(value.args[6]) if len(value.args) > 6 else None
    if not (
        isinstance(storage, _StorageRef)
        and dtype is not None
        and _is_count(offset)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and all(_is_count(x) for x in (*size, *stride))
    ):
        raise _Unreadable("a tensor with malformed rebuild arguments")
    numel = 1
    for n in size:
        numel *= n
    reach = 0
    if numel:
        reach = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * dtype.itemsize
    return (tuple(size), dtype), storage, reach


def _records(f: io.BufferedReader, size: int) -> tuple[str, dict[str, tuple[int, int]]]:
    """The archive folder and each record's ``(start, length)``, keyed by lower-case name,
    after checking that every record is stored, lies inside the file, and is the only
    one of its name (torch finds records by name, ignoring case)."""
    f.seek(0)
    with zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
    if not infos or "/" not in infos[0].filename:
        raise _Unreadable("no torch archive folder")
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    spans: dict[str, tuple[int, int]] = {}
    for info in infos:
        name = info.filename
        if not name.startswith(prefix) or name.lower() in spans:
            raise _Unreadable(f"unexpected or repeated record {name!r}")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise _Unreadable(f"record {name!r} is compressed")
        f.seek(info.header_offset)
        head = f.read(30)
        if len(head) < 30 or head[:4] != _LOCAL_HEADER:
            raise _Unreadable(f"record {name!r} has no local header")
        n_name, n_extra = struct.unpack("<HH", head[26:30])
        start = info.header_offset + 30 + n_name + n_extra
        if start + info.file_size > size:
            raise _Unreadable(f"record {name!r} runs past the end of the file")
        spans[name.lower()] = (start, info.file_size)
    return prefix, spans


def _scan(fn: str, path: str, f: io.BufferedReader, size: int) -> dict[str, _Meta]:
    """Reads the zip directory and the pickle of a torch file without building anything
    and returns each key's shape and dtype.

    Raises ``ValueError`` naming the path (and the key) for anything ``torch.load`` could
    misread: a storage declaring more bytes than its record holds (``torch.load`` would
    read past it: heap memory, or a crash), a view reaching past its storage, records
    outside the file or ambiguous, or a value that is not a plain dense tensor.
    """
    try:
        prefix, spans = _records(f, size)
        pkl = spans.get(f"{prefix}data.pkl".lower())
        if pkl is None:
            raise _Unreadable("no data.pkl")
        f.seek(pkl[0])
        scanner = _Scanner(f.read(pkl[1]), {k: n for k, (_, n) in spans.items()}, prefix)
        top = scanner.load()
        if not isinstance(top, dict) or not all(isinstance(k, str) for k in top):
            raise _Unreadable(f"expected a dict of str to tensors, got {_checks.describe(top)}")
        metas: dict[str, _Meta] = {}
        for key, value in top.items():
            try:
                metas[key], storage, reach = _tensor_meta(value)
            except _Unreadable as e:
                raise _Unreadable(f"{key!r}: {e}") from None
            _check_fits(fn, path, repr(key), storage, reach)
        for storage in scanner.storages:  # any not behind a key (none in a valid file)
            _check_fits(fn, path, "a storage", storage, 0)
        return metas
    except (_Unreadable, zipfile.BadZipFile, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{_unreadable(fn, path)}: {e}") from None
    except NotImplementedError as e:  # zipfile: a version or method it cannot read
        raise ValueError(
            f"{_unreadable(fn, path)}: its zip archive uses a feature torch.save never writes ({e})"
        ) from None
    except (TypeError, AttributeError, IndexError, KeyError, OverflowError, struct.error) as e:
        raise ValueError(f"{_unreadable(fn, path)}: {type(e).__name__}: {e}") from None
    except ValueError as e:
        if str(e).startswith(f"{fn}: "):
            raise
        raise ValueError(f"{_unreadable(fn, path)}: {e}") from None


def _check_fits(fn: str, path: str, what: str, storage: _StorageRef, reach: int) -> None:
    if storage.nbytes > storage.held:
        raise ValueError(
            f"{fn}: {path!r}: {what} declares {storage.numel} elements of {storage.dtype} "
            f"({storage.nbytes} bytes) in record {storage.record!r}, which holds "
            f"{storage.held} bytes; the file is corrupt or forged, and nothing was loaded"
        )
    if reach > storage.nbytes:
        raise ValueError(
            f"{fn}: {path!r}: {what} reaches {reach} bytes into its storage "
            f"{storage.record!r} of {storage.nbytes}; the file is corrupt or forged, and "
            f"nothing was loaded"
        )


def _unreadable(fn: str, path: str) -> str:
    return (
        f"{fn}: {path!r} is not a readable mpfunc checkpoint (truncated, corrupt, or "
        f"holding objects other than tensors, which are refused)"
    )
