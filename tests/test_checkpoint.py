"""Checkpoints: exact resume in a fresh process, round trips, bad files, security, DCP."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
from typing import Any

import optree
import pytest
import torch
from support.helpers import assert_trees_bits_equal, assert_unchanged, snapshot
from workers.resume_common import CONFIGS, Run, config_name

import mpfunc

HERE = pathlib.Path(__file__).resolve().parent


def test_exact_resume_in_a_fresh_process(device: torch.device, tmp_path: pathlib.Path) -> None:
    """Train k steps, save, load in a fresh process and train to N: bit-identical to N
    uninterrupted steps (masters, optimizer state, loss scale, model params), for
    sgd/adam/adamw with and without dynamic loss scaling (with skipped overflow steps)."""
    k, n = 3, 7
    for opt, scaling in CONFIGS:
        run = Run(device, opt, scaling)
        run.train(0, k)
        mpfunc.save(tmp_path / f"{config_name(opt, scaling)}-step{k}.pt", run.tree())
    env = dict(os.environ, PJRT_DEVICE="CPU")
    subprocess.run(
        [
            sys.executable,
            str(HERE / "workers" / "resume_common.py"),
            device.type,
            str(tmp_path),
            str(k),
            str(n),
        ],
        check=True,
        env=env,
        timeout=300,
    )
    for opt, scaling in CONFIGS:
        straight = Run(device, opt, scaling)
        straight.train(0, n)
        resumed = mpfunc.load(
            tmp_path / f"{config_name(opt, scaling)}-resumed{n}.pt", like=straight.tree()
        )
        assert_trees_bits_equal(resumed, straight.tree())
        if scaling:  # the scale state came back whole, settings from `like`
            assert repr(resumed["scale"]) == repr(straight.scaler) or device.type != "cpu"


def full_tree(device: torch.device) -> dict[str, Any]:
    run = Run(device, "adam", True)
    run.train(0, 2)
    return run.tree()


def test_round_trip_is_bit_identical(device: torch.device) -> None:
    tree = full_tree(device)
    sd = mpfunc.state_dict(tree)
    assert "masters.0.weight" in sd and "opt.exp_avg.0.weight" in sd
    assert "opt.max_exp_avg_sq.2.bias" in sd and "scale.loss_scale" in sd
    assert "scale.counter" in sd and "opt.step.0.weight" in sd
    back = mpfunc.load_state_dict(tree, sd)
    assert_trees_bits_equal(back, tree)
    # Fresh tensors, on the tree's devices.
    for a, b in zip(
        optree.tree_leaves(back, namespace="mpfunc"), optree.tree_leaves(tree, namespace="mpfunc")
    ):
        assert a.device == b.device and (
            a.numel() == 0 or a.data_ptr() != b.data_ptr() or a.device.type == "xla"
        )


def test_save_and_load_restore_to_the_device(device: torch.device, tmp_path: pathlib.Path) -> None:
    tree = full_tree(device)
    mpfunc.save(tmp_path / "ck.pt", tree)
    raw = torch.load(tmp_path / "ck.pt", weights_only=True)  # plain torch reads it
    assert all(v.device.type == "cpu" for v in raw.values())  # saved from the host
    assert set(raw) == {*mpfunc.state_dict(tree), "__mpfunc_manifest__"}
    assert raw["__mpfunc_manifest__"].dtype == torch.uint8
    back = mpfunc.load(tmp_path / "ck.pt", like=tree)
    assert_trees_bits_equal(back, tree)
    for a in optree.tree_leaves(back, namespace="mpfunc"):
        assert a.device.type == device.type


def test_masters_export_loads_into_an_fp32_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(torch.bfloat16)
    masters = mpfunc.init_master(dict(model.named_parameters()))
    masters["0.weight"].add_(0.001)  # masters ahead of the bf16 model, as in training
    fp32 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    result = fp32.load_state_dict(mpfunc.masters_state_dict(masters), strict=False)
    assert result.unexpected_keys == []
    assert {"1.running_mean", "1.running_var"} <= set(result.missing_keys)  # buffers only
    assert all("running" in k or "num_batches" in k for k in result.missing_keys)
    assert torch.equal(fp32[0].weight.detach(), masters["0.weight"])


def _bad_files(tmp_path: pathlib.Path, good: pathlib.Path) -> dict[str, pathlib.Path]:
    data = good.read_bytes()
    files = {}
    files["truncated"] = tmp_path / "truncated.pt"
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["random"] = tmp_path / "random.pt"
    files["random"].write_bytes(os.urandom(4096))
    other = Run(torch.device("cpu"), "sgd", False)  # another model's state: other keys
    files["other-keys"] = tmp_path / "other.pt"
    mpfunc.save(files["other-keys"], other.tree())
    # Files of the same tree with one entry changed, written (and checksummed) by mpfunc:
    # a flat dict's dotted keys are its paths.
    sd = _raw(good)
    sd["masters.0.weight"] = torch.zeros(5, 5)
    files["other-shape"] = tmp_path / "shape.pt"
    mpfunc.save(files["other-shape"], sd)
    sd = _raw(good)
    sd["opt.exp_avg.0.weight"] = sd["opt.exp_avg.0.weight"].double()
    files["wrong-dtype"] = tmp_path / "dtype.pt"
    mpfunc.save(files["wrong-dtype"], sd)
    return files


def _raw(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors, read with plain torch.load, without mpfunc's manifest."""
    sd = torch.load(path, weights_only=True)
    del sd["__mpfunc_manifest__"]
    return sd


@pytest.mark.parametrize(
    "kind, message",
    [
        ("truncated", r"not a readable mpfunc checkpoint"),
        ("random", r"not a readable mpfunc checkpoint"),
        (
            "other-keys",
            r"does not match the tree \(\d+ problems\): missing key "
            r"'opt\.exp_avg\.0\.bias'.*unexpected key 'opt\.momentum_buffer",
        ),
        ("other-shape", r"'masters\.0\.weight': expected shape \(16, 8\), got \(5, 5\)"),
        ("wrong-dtype", r"'opt\.exp_avg\.0\.weight': expected torch\.float32, got torch\.float64"),
    ],
)
def test_bad_files_give_clear_errors_and_touch_nothing(
    tmp_path: pathlib.Path, kind: str, message: str
) -> None:
    tree = full_tree(torch.device("cpu"))
    good = tmp_path / "good.pt"
    mpfunc.save(good, tree)
    bad = _bad_files(tmp_path, good)[kind]
    snap = snapshot(tree)
    with pytest.raises(ValueError, match=message):
        mpfunc.load(bad, like=tree)
    assert_unchanged(tree, snap)


def test_failed_save_keeps_the_previous_checkpoint(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = full_tree(torch.device("cpu"))
    path = tmp_path / "ck.pt"
    mpfunc.save(path, tree)
    before = path.read_bytes()

    def crash(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial garbage")  # a crash mid-write
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    changed = mpfunc.load_state_dict(tree, mpfunc.state_dict(tree))
    changed["masters"]["0.weight"].add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        mpfunc.save(path, changed)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert_trees_bits_equal(mpfunc.load(path, like=tree), tree)
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {_Evil.marker}",))

    marker = ""


def test_a_malicious_file_is_refused_and_its_code_never_runs(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    path = tmp_path / "evil.pt"
    torch.save({"masters.0.weight": _Evil()}, path)
    tree = full_tree(torch.device("cpu"))
    with pytest.raises(ValueError, match="not a readable mpfunc checkpoint"):
        mpfunc.load(path, like=tree)
    assert not marker.exists()
    # A plain pickle of the same object is refused too.
    path.write_bytes(pickle.dumps({"x": _Evil()}))
    with pytest.raises(ValueError, match="not a readable mpfunc checkpoint"):
        mpfunc.load(path, like=tree)
    assert not marker.exists()


def test_state_dict_rejects_non_tensor_leaves_and_key_collisions() -> None:
    with pytest.raises(
        TypeError, match=r"state_dict: at 'lr': expected a tensor or None leaf, got float 0\.1"
    ):
        mpfunc.state_dict({"w": torch.ones(1), "lr": 0.1})
    with pytest.raises(ValueError, match=r"same key 'a\.b'"):
        mpfunc.state_dict({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


# DCP warns when it runs without a process group (single-process is the point here;
# torch 2.9 and 2.4 word it differently), torch 2.9's own DCP writer calls the
# deprecated Tensor.storage(), and torch 2.4's reader calls torch.load without
# weights_only.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.filterwarnings("ignore:You are using `torch.load` with `weights_only:FutureWarning")
def test_torch_distributed_checkpoint_writes_it(tmp_path: pathlib.Path) -> None:
    """The state dict is plain str -> tensor, so torch.distributed.checkpoint saves and
    loads it as is (here without a process group), ready for sharded saving."""
    import torch.distributed.checkpoint as dcp

    tree = full_tree(torch.device("cpu"))
    sd = mpfunc.state_dict(tree)
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(tmp_path / "dcp"))
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    assert_trees_bits_equal(mpfunc.load_state_dict(tree, target), tree)


def _takes_uint4() -> bool:
    """torch 2.4's weights_only unpickler refuses the dtype torch.uint4 itself."""
    import io

    buf = io.BytesIO()
    torch.save(torch.uint4, buf)  # type: ignore[attr-defined]
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError:
        return False
    return True


@pytest.mark.parametrize("strategy", ["fp32", "remainder", "kahan", "stochastic", "none"])
def test_plain_torch_save_of_masters_and_state_loads_weights_only(
    strategy: str, tmp_path: pathlib.Path
) -> None:
    """The everyday habit: ``torch.save({"masters": m, "state": s, ...})`` and, at resume,
    ``torch.load(path)`` (``weights_only=True``, torch's default since 2.6). Units and
    optimizer states are NamedTuples of tensors and were not on torch's allowlist, so the
    load failed ("Unsupported global: RemainderMaster", "AdamState"); they are now, with
    every state format, SGD, Lion, a partition and ``stats=``: the trees come back bit
    for bit."""
    gen = torch.Generator().manual_seed(2)
    p = {"w": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
         "b": torch.randn(32, generator=gen).to(torch.bfloat16)}  # fmt: skip
    m = mpfunc.init_master(p, strategy=strategy)
    dtypes = [None, torch.bfloat16, torch.uint8]
    if _takes_uint4():
        dtypes.append(torch.uint4)  # type: ignore[attr-defined]
    for sd in dtypes:
        opt = mpfunc.partition(
            {"a": mpfunc.adamw(state_dtype=sd), "s": mpfunc.sgd(lr=0.1, momentum=0.9),
             "l": mpfunc.lion()}, {"w": "a", "b": "s" if sd is None else "l"},
        )  # fmt: skip
        s = opt.init(m)
        g = {k: torch.randn(v.shape, generator=gen).to(torch.bfloat16) for k, v in p.items()}
        stats = mpfunc.init_stats(m)
        mpfunc.apply_update_(m, g, s, opt, params=p, stats=stats)
        tree = {"masters": m, "state": s, "stats": stats, "scale": mpfunc.DynamicLossScale()}
        torch.save(tree, tmp_path / "ckpt.pt")
        back = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        assert_trees_bits_equal(back, tree)
