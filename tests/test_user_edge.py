"""Trust at the user's edge (issue 20): files left by killed saves, paths and files that
are not what ``save``/``load`` take, and a functional optimizer used as a torch.optim one.
"""

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


# --- item 9: forged files and paths that are not a file's ------------------------------------

_SEAL = b"mpfunc-checkpoint v1 crc32="


def _reseal(data: bytearray) -> bytes:
    """``data`` (a file from ``save`` whose seal was cut off, comment length 0) with the
    seal ``save`` writes: a forger can compute it (the format is in _checkpoint.py)."""
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


# --- item 12: a functional optimizer used as a torch.optim one --------------------------------

_POINTER = (
    r"mpfunc\.MasterOptimizer\(model\.parameters\(\), opt=mpfunc\.{}.*mpfunc\.apply_update_\("
)


@pytest.mark.parametrize("factory", ["sgd", "adam", "adamw", "lion"])
@pytest.mark.parametrize(
    "use",
    [
        lambda opt: opt.step(),
        lambda opt: opt.zero_grad(),
        lambda opt: opt.param_groups,
        lambda opt: opt.state_dict(),
        lambda opt: opt.load_state_dict({}),
        lambda opt: opt.add_param_group({}),
        lambda opt: opt.state,
        lambda opt: opt.defaults,
    ],
    ids=["step", "zero_grad", "param_groups", "state_dict", "load", "add_group", "state", "defs"],
)
def test_torch_optim_habits_on_a_functional_optimizer_point_to_the_fix(
    factory: str, use: Any
) -> None:
    """Issue 20, item 12: ``mpfunc.adamw().step()`` said only "'Optimizer' object has no
    attribute 'step'". The AttributeError now names ``mpfunc.MasterOptimizer`` (with the
    factory to pass) and ``mpfunc.apply_update_``."""
    opt = getattr(mpfunc, factory)(**({"lr": 0.1} if factory == "sgd" else {}))
    with pytest.raises(AttributeError, match=_POINTER.format(factory)) as info:
        use(opt)
    assert info.value.name in str(info.value) and info.value.obj is opt


def test_the_optimizer_stays_a_plain_named_tuple() -> None:
    """The pointer changes nothing else: optree flattens the Optimizer as before (four
    leaves, a namedtuple node), it pickles and copies, its fields read as before, and
    other missing attributes give the plain AttributeError (``hasattr`` and copy's
    ``__deepcopy__`` probe still work)."""
    import copy
    import pickle

    import optree

    from mpfunc.core._optimizer import Optimizer

    opt = mpfunc.adamw()
    leaves, spec = optree.tree_flatten(opt)
    assert leaves == [opt.init, opt.plan, True, "adamw"]
    assert spec.kind == optree.PyTreeKind.NAMEDTUPLE and spec.type is Optimizer
    assert optree.tree_unflatten(spec, leaves) == opt
    assert not hasattr(opt, "step") and not hasattr(opt, "param_groups")
    assert copy.copy(opt) == opt and copy.deepcopy(opt) == opt
    assert opt._replace(name="x").name == "x" and opt._fields == Optimizer._fields
    picklable = Optimizer(len, len, False, "sgd")  # the factories' closures are local
    assert pickle.loads(pickle.dumps(picklable)) == picklable
    with pytest.raises(AttributeError, match=r"^'Optimizer' object has no attribute 'stpe'$"):
        opt.stpe  # noqa: B018
    other = mpfunc.torch_optimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(AttributeError, match=r"this optimizer \('torch\.SGD'\).*opt=mpfunc\.adamw"):
        other.step()


def _schedulers() -> list[Any]:
    s = torch.optim.lr_scheduler
    return [
        pytest.param(lambda o: s.LambdaLR(o, lambda n: 1.0), "pointer", id="LambdaLR"),
        pytest.param(lambda o: s.MultiplicativeLR(o, lambda n: 1.0), "pointer", id="Mult"),
        pytest.param(lambda o: s.StepLR(o, 1), "torch", id="StepLR"),
        pytest.param(lambda o: s.MultiStepLR(o, [1]), "torch", id="MultiStepLR"),
        pytest.param(lambda o: s.ConstantLR(o), "torch", id="ConstantLR"),
        pytest.param(lambda o: s.LinearLR(o), "torch", id="LinearLR"),
        pytest.param(lambda o: s.ExponentialLR(o, 0.9), "torch", id="ExponentialLR"),
        pytest.param(lambda o: s.PolynomialLR(o), "torch", id="PolynomialLR"),
        pytest.param(lambda o: s.CosineAnnealingLR(o, 10), "torch", id="Cosine"),
        pytest.param(lambda o: s.CosineAnnealingWarmRestarts(o, 10), "torch", id="Restarts"),
        pytest.param(lambda o: s.CyclicLR(o, 0.1, 1.0), "torch", id="CyclicLR"),
        pytest.param(lambda o: s.OneCycleLR(o, 1.0, total_steps=10), "torch", id="OneCycle"),
        pytest.param(lambda o: s.ReduceLROnPlateau(o), "torch", id="Plateau"),
    ]


@pytest.mark.parametrize(("make", "says"), _schedulers())
def test_an_lr_scheduler_on_a_functional_optimizer(make: Any, says: str) -> None:
    """Issue 20, item 12: what a user sees when handing ``mpfunc.adamw()`` to a
    torch.optim.lr_scheduler. Schedulers that read ``optimizer.param_groups`` first
    (LambdaLR, MultiplicativeLR) now raise the AttributeError naming
    ``mpfunc.MasterOptimizer`` and ``mpfunc.apply_update_`` (before: "no attribute
    'param_groups'"). The others start with torch's own check,
    ``isinstance(optimizer, torch.optim.Optimizer)``, and raise torch's TypeError
    "Optimizer is not an Optimizer" before touching the object: mpfunc cannot change
    that message without monkeypatching torch (which it does not do), so it is pinned
    here as documentation. MasterOptimizer itself works with every scheduler
    (tests/test_master_optimizer.py)."""
    opt = mpfunc.adamw()
    if says == "pointer":
        with pytest.raises(AttributeError, match=_POINTER.format("adamw")):
            make(opt)
    else:
        with pytest.raises(TypeError, match=r"^Optimizer is not an Optimizer$"):
            make(opt)


# --- item 1: a param written behind the step's back is the truth --------------------------

# (optimizer factory, impls): "auto" takes the native single pass on CPU for AdamW and
# the one-node kernel on XLA; "foreach" and "fused" the torch path.
_WRITERS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "adamw": (
        lambda impl: mpfunc.adamw(1e-3, weight_decay=0.1, impl=impl),
        ("auto", "foreach", "fused"),
    ),
    "adamw-uint8": (
        lambda impl: mpfunc.adamw(1e-3, state_dtype=torch.uint8, impl=impl),
        ("auto", "foreach"),
    ),
    "sgd": (lambda impl: mpfunc.sgd(1e-3, momentum=0.9, impl=impl), ("auto", "foreach")),
    "lion": (lambda impl: mpfunc.lion(1e-3, impl=impl), ("auto", "foreach")),
}
_WRITTEN = torch.linspace(-3, 7, 64 * 40).view(64, 40)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


_CASES = [(name, impl) for name, (_, impls) in _WRITERS.items() for impl in impls]


def _behind_the_back(
    name: str,
    impl: str,
    how: str,
    device: torch.device,
    *,
    skip_first: bool = False,
    transposed: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two steps of one tree; between them the first param is written behind the step's
    back (``how``) and, in the reference, the same value also goes into its master, the
    one supported way before. ``transposed``: the first param is a transposed view (its
    master copies that layout, its grad is contiguous: the native pass stages the leaf
    through contiguous copies). Returns (params, masters) of (the run, the reference)."""
    make = _WRITERS[name][0]
    out = []
    for reference in (False, True):
        g = torch.Generator().manual_seed(0)
        shapes = [(64, 40), (33,)]
        params = [torch.randn(s, generator=g).bfloat16().to(device) for s in shapes]
        if transposed:
            params[0] = params[0].t().contiguous().t()
        grads = [
            torch.randn(p.shape, generator=g).bfloat16().to(device).contiguous() for p in params
        ]
        masters = mpfunc.init_master(params)
        opt = make(impl)
        state = opt.init(masters)
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        new = _WRITTEN.bfloat16().to(device)
        if how == "fill":
            params[0].data.copy_(new)
        elif how == "assign":
            params[0].data = new.clone()
        else:  # a few elements only, in place under no_grad, as weight surgery does
            with torch.no_grad():
                params[0].data[3, 5:9] = new[3, 5:9]
        if reference:
            with torch.no_grad():
                same = params[0] == masters[0].bfloat16()
                masters[0].copy_(torch.where(same, masters[0], params[0].float()))
        if skip_first:
            skip = torch.tensor(True, device=device)
            mpfunc.apply_update_(masters, grads, state, opt, skip=skip, params=params)
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        out.append(([p.cpu() for p in params], [m.cpu() for m in masters]))
    return out[0], out[1]


@pytest.mark.parametrize("how", ["fill", "assign", "some"])
@pytest.mark.parametrize(("name", "impl"), _CASES, ids=[f"{n}-{i}" for n, i in _CASES])
def test_a_param_written_behind_the_steps_back_is_kept(name: str, impl: str, how: str) -> None:
    """``p.data.copy_(t)``, ``p.data = t`` or a partial write between steps: the next step
    starts from the param's new value (as torch.optim's would), bit for bit as if the
    value had been written into the master too, on every kernel; it is never undone."""
    (params, masters), (ref_params, ref_masters) = _behind_the_back(
        name, impl, how, torch.device("cpu")
    )
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])
    if how != "some":
        assert float((params[0].float() - _WRITTEN).abs().max()) < 0.1


@pytest.mark.parametrize("how", ["fill", "some"])
@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_a_transposed_param_written_behind_the_steps_back_is_kept(impl: str, how: str) -> None:
    (params, masters), (ref_params, ref_masters) = _behind_the_back(
        "adamw", impl, how, torch.device("cpu"), transposed=True
    )
    assert not params[0].is_contiguous()
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])


def test_a_skipped_step_keeps_the_master_and_the_next_one_refreshes() -> None:
    (params, masters), (ref_params, ref_masters) = _behind_the_back(
        "adamw", "auto", "fill", torch.device("cpu"), skip_first=True
    )
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])


@pytest.mark.xla
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_a_param_written_behind_the_steps_back_is_kept_on_xla(
    xla_device: torch.device, name: str, impl: str
) -> None:
    (params, masters), (ref_params, ref_masters) = _behind_the_back(name, impl, "fill", xla_device)
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])
    assert float((params[0].float() - _WRITTEN).abs().max()) < 0.1


def test_master_optimizer_keeps_a_write_through_data() -> None:
    """The issue's case: with the default "fp32" strategy, ``p.data.fill_(7)`` between
    steps of MasterOptimizer is kept, as torch.optim keeps it (0.43 came back before)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).bfloat16()
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = mpfunc.MasterOptimizer(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    for k in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x.to(next(m.parameters()).dtype)).square().mean().backward()
            o.step()
            o.zero_grad()
        if k == 0:
            model.weight.data.fill_(7)
            ref.weight.data.fill_(7)
    w, w_ref = model.weight.detach().float(), ref.weight.detach()
    assert float((w - w_ref).abs().max()) < 0.05
    assert float(w.mean()) > 6.9
