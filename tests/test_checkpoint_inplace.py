"""Resuming in place: ``load_`` and ``load_state_dict_`` write into the run's own tensors,
so an optimizer built with a tensor lr reads the restored value, and the resumed run is
bit-identical to an uninterrupted one. Every check runs before the first write."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from support.helpers import assert_trees_bits_equal, assert_unchanged, leaves, snapshot
from workers.resume_common import Run

import mpfunc


def tensor_lr_run(device: torch.device) -> tuple[Run, torch.Tensor]:
    """The resume tests' model, with AdamW reading a 0-d lr tensor."""
    run = Run(device, "adamw", False)
    lr = torch.tensor(1e-2, device=device)
    run.opt = mpfunc.adamw(lr=lr, weight_decay=0.1)
    run.state = run.opt.init(run.masters)
    return run, lr


def train(run: Run, lr: torch.Tensor, start: int, stop: int) -> None:
    for step in range(start, stop):
        run.train(step, step + 1)
        lr.mul_(0.7)  # a schedule kept on the device, in the lr tensor itself


def checkpoint(run: Run, lr: torch.Tensor) -> dict[str, Any]:
    return {**run.tree(), "lr": lr}  # masters, state, model params and lr


def test_resume_with_a_tensor_lr_is_bit_identical(
    device: torch.device, tmp_path: pathlib.Path
) -> None:
    """k steps, save, a fresh run restored with ``load_``, on to n steps: masters, AdamW
    state, the model's params and the lr equal n uninterrupted steps bit for bit. The
    restored run keeps its own tensor objects, so its optimizer reads the restored lr."""
    k, n = 2, 4
    straight, straight_lr = tensor_lr_run(device)
    train(straight, straight_lr, 0, n)

    first, first_lr = tensor_lr_run(device)
    train(first, first_lr, 0, k)
    mpfunc.save(tmp_path / "ck.pt", checkpoint(first, first_lr))

    resumed, resumed_lr = tensor_lr_run(device)
    ckpt = checkpoint(resumed, resumed_lr)
    objects = [id(t) for t in leaves(ckpt)]
    assert mpfunc.load_(tmp_path / "ck.pt", ckpt) is ckpt
    assert [id(t) for t in leaves(ckpt)] == objects  # the same tensors, written in place
    assert_trees_bits_equal(resumed_lr, first_lr)  # the optimizer's own lr tensor
    train(resumed, resumed_lr, k, n)
    assert_trees_bits_equal(checkpoint(resumed, resumed_lr), checkpoint(straight, straight_lr))


def test_load_state_dict_inplace_round_trip_and_purity(device: torch.device) -> None:
    """``load_state_dict_`` writes the values into the same tensors; ``load_state_dict``
    and ``load`` never touch the tree."""
    run, lr = tensor_lr_run(device)
    train(run, lr, 0, 1)
    tree = checkpoint(run, lr)
    sd = {k: v.clone() for k, v in mpfunc.state_dict(tree).items()}
    snap = snapshot(tree)
    fresh = mpfunc.load_state_dict(tree, sd)
    assert_unchanged(tree, snap)
    train(run, lr, 1, 2)  # the run moves on; then rewinds
    mpfunc.load_state_dict_(tree, sd)
    assert_trees_bits_equal(tree, fresh)


def _bad_dtype_sd(tree: Any) -> dict[str, torch.Tensor]:
    sd = {k: v.clone() for k, v in mpfunc.state_dict(tree).items()}
    sd["opt.exp_avg.0.weight"] = sd["opt.exp_avg.0.weight"].double()
    return sd


def test_loading_never_casts_a_dtype(tmp_path: pathlib.Path) -> None:
    """A float64 value for a float32 leaf is refused by every loader (pytorch#43706,
    torchtitan#4615), and nothing is written."""
    run, lr = tensor_lr_run(torch.device("cpu"))
    tree = checkpoint(run, lr)
    sd = _bad_dtype_sd(tree)
    mpfunc.save(tmp_path / "f64.pt", sd)
    snap = snapshot(tree)
    message = r"'opt\.exp_avg\.0\.weight': expected torch\.float32, got torch\.float64"
    for call in (
        lambda: mpfunc.load_state_dict(tree, sd),
        lambda: mpfunc.load_state_dict_(tree, sd),
        lambda: mpfunc.load(tmp_path / "f64.pt", like=tree),
        lambda: mpfunc.load_(tmp_path / "f64.pt", tree),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    assert_unchanged(tree, snap)


def test_every_check_runs_before_the_first_write(tmp_path: pathlib.Path) -> None:
    """Only the last key is wrong: the whole tree keeps its bits and versions."""
    run, lr = tensor_lr_run(torch.device("cpu"))
    tree = checkpoint(run, lr)
    sd = {k: v.clone() + 1 for k, v in mpfunc.state_dict(tree).items()}
    last = sorted(sd)[-1]
    sd[last] = torch.zeros(7)
    snap = snapshot(tree)
    with pytest.raises(ValueError, match=rf"'{last}': expected shape"):
        mpfunc.load_state_dict_(tree, sd)
    mpfunc.save(tmp_path / "bad.pt", sd)
    with pytest.raises(ValueError, match=rf"'{last}': expected shape"):
        mpfunc.load_(tmp_path / "bad.pt", tree)
    assert_unchanged(tree, snap)


def test_leaves_that_cannot_take_a_copy_are_refused() -> None:
    """An expanded leaf (stride 0), an inference tensor, overlapping leaves, and one tensor
    appearing twice with two different values: refused before anything is written."""
    base = torch.zeros(8)
    with torch.inference_mode():
        frozen = torch.zeros(2)
    cases: list[tuple[dict[str, Any], dict[str, torch.Tensor], str]] = [
        ({"a": torch.zeros(1).expand(4)}, {"a": torch.ones(4)}, r"'a' is expanded"),
        (
            {"a": base[0:4], "b": base[2:6]},
            {"a": torch.ones(4), "b": torch.ones(4)},
            r"'a' and 'b' share memory",
        ),
        (
            {"a": base, "b": base},
            {"a": torch.ones(8), "b": torch.full((8,), 2.0)},
            r"'a' and 'b' are one tensor, but their saved values differ",
        ),
    ]
    for tree, sd, message in cases:
        snap = snapshot(tree)
        with pytest.raises(ValueError, match=message):
            mpfunc.load_state_dict_(tree, sd)
        assert_unchanged(tree, snap)
    with pytest.raises(ValueError, match=r"'a' is an inference tensor"):
        mpfunc.load_state_dict_({"a": frozen}, {"a": torch.ones(2)})
    assert torch.equal(frozen, torch.zeros(2))  # (inference tensors have no version)
    # One tensor twice with the same values (tied weights) is fine.
    mpfunc.load_state_dict_({"a": base, "b": base}, {"a": torch.ones(8), "b": torch.ones(8)})
    assert torch.equal(base, torch.ones(8))


def test_values_sharing_memory_with_the_tree_are_read_before_written() -> None:
    """A state dict whose values are the tree's own tensors, swapped: each value is copied
    aside before the leaf holding it is overwritten."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    tree = {"a": a, "b": b}
    mpfunc.load_state_dict_(tree, {"a": b, "b": a})
    assert torch.equal(a, torch.tensor([3.0, 4.0])) and torch.equal(b, torch.tensor([1.0, 2.0]))
    base = torch.arange(6.0)
    tree = {"a": base[0:3], "b": base[3:6]}
    mpfunc.load_state_dict_(tree, {"a": base[1:4], "b": base[0:3]})  # overlapping both
    assert torch.equal(base, torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0, 2.0]))


def test_kinds_without_plain_values_are_refused() -> None:
    """A sparse value, or a leaf on the meta device (it could not hold what is loaded),
    is a listed problem, not a silent conversion or an empty result."""
    with pytest.raises(ValueError, match=r"'a': expected a dense tensor, got .*sparse_coo"):
        mpfunc.load_state_dict({"a": torch.zeros(3, 3)}, {"a": torch.eye(3).to_sparse()})
    meta = {"a": torch.zeros(3, device="meta")}
    with pytest.raises(ValueError, match=r"'a': the tree's leaf must be a tensor with data"):
        mpfunc.load_state_dict(meta, {"a": torch.ones(3)})


def test_interleaved_leaves_sharing_no_element_load_in_place(tmp_path: Any) -> None:
    """Column slices of one buffer (x[:, :8], x[:, 8:]): their byte ranges interleave, their
    elements do not. The step and save took them, but load_ and load_state_dict_ refused
    them as leaves that 'would overwrite' each other, so such a run could not resume in
    place. They load now; interleaved slices that do share elements, a row crossing a
    column, are still refused; and a saved value interleaved with a leaf it is read after
    is copied aside first (the swapped columns come back swapped)."""
    buf = torch.arange(128.0).reshape(8, 16)
    tree = {"a": buf[:, :8], "b": buf[:, 8:]}
    sd = {"a": torch.full((8, 8), 1.0), "b": torch.full((8, 8), 2.0)}
    mpfunc.save(tmp_path / "cols.pt", sd)
    mpfunc.load_(tmp_path / "cols.pt", tree)
    assert torch.equal(buf[:, :8], sd["a"]) and torch.equal(buf[:, 8:], sd["b"])
    mpfunc.load_state_dict_(tree, {"a": buf[:, 8:], "b": buf[:, :8]})  # its own columns, swapped
    assert torch.equal(buf[:, :8], sd["b"]) and torch.equal(buf[:, 8:], sd["a"])
    crossing = {"a": buf[2], "b": buf[:, 3]}
    snap = snapshot(crossing)
    with pytest.raises(ValueError, match=r"'[ab]' and '[ab]' share memory"):
        mpfunc.load_state_dict_(crossing, {"a": torch.zeros(16), "b": torch.zeros(8)})
    assert_unchanged(crossing, snap)
