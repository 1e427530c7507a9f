"""Checkpoints: ``state_dict``/``load_state_dict`` over any mpfunc tree, and atomic,
code-free ``save``/``load`` files in torch's own format.

A state dict is a plain ``dict[str, Tensor]`` keyed by dotted pytree paths
(``"masters.layers.0.weight"``, ``"opt.exp_avg.layers.0.weight"``): no pickled
Python objects, so ``torch.load(weights_only=True)`` reads it and
``torch.distributed.checkpoint`` can write it. What is not a tensor (a loss
scale's settings, the tree's structure) comes from the ``like`` tree at load time.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Union

import torch

from mpfunc import _checks, _tree

__all__ = ["load", "load_state_dict", "masters_state_dict", "save", "state_dict"]

PathLike = Union[str, "os.PathLike[str]"]


def _keyed_leaves(fn: str, tree: Any) -> tuple[list[str | None], list[Any], Any]:
    """Each leaf with its dotted path (``None`` for ``None`` leaves), after checking that
    every leaf is a tensor or ``None`` and that no two paths collide."""
    leaves, spec = _tree.flatten(tree)
    _checks.check_tensor_or_none(fn, "", tree, leaves)
    keys: list[str | None] = []
    seen: dict[str, int] = {}
    paths = _tree.leaf_paths(tree)
    for i, leaf in enumerate(leaves):
        if leaf is None:
            keys.append(None)
            continue
        key = paths[i]
        if key in seen:
            raise ValueError(
                f"{fn}: two leaves have the same key {key!r} (a dict key containing '.' "
                f"shadows a nested path); rename one"
            )
        seen[key] = i
        keys.append(key)
    return keys, leaves, spec


def state_dict(tree: Any) -> dict[str, torch.Tensor]:
    """Flattens any mpfunc tree into ``{dotted path: tensor}``.

    Works for masters, optimizer states, loss scales, or a dict holding all of
    them. ``None`` leaves have no entry. Values are the tree's own tensors,
    detached (not copies), on their devices.

    Raises:
      TypeError: a leaf is neither a tensor nor ``None`` (the dict holds tensors only).
      ValueError: two leaves would get the same key.

    Example::

      sd = mpfunc.state_dict({"masters": masters, "opt": state, "scale": scaler})
      sd["opt.exp_avg.layers.0.weight"]
    """
    keys, leaves, _ = _keyed_leaves("state_dict", tree)
    return {k: t.detach() for k, t in zip(keys, leaves) if k is not None}


def load_state_dict(like: Any, sd: dict[str, torch.Tensor]) -> Any:
    """Returns a new tree shaped like ``like``, on ``like``'s devices, holding ``sd``'s values.

    The whole dict is checked first: missing keys, unexpected keys, and shape or
    dtype mismatches are reported together in one error, and nothing is returned
    half-loaded. ``like`` itself is never modified.

    Args:
      like: a tree of the wanted structure (e.g. freshly initialized masters and state).
      sd: a ``dict[str, Tensor]`` from ``state_dict`` or ``torch.load``.

    Returns:
      A tree of ``like``'s structure with fresh tensors.

    Raises:
      TypeError: ``sd`` is not a dict of str to tensors, or ``like`` has a non-tensor leaf.
      ValueError: keys, shapes or dtypes do not match (all problems listed).
    """
    fn = "load_state_dict"
    if not isinstance(sd, dict):
        raise TypeError(f"{fn}: sd: expected a dict of str to tensors, got {type(sd).__name__}")
    bad_values = [
        k for k, v in sd.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))
    ]
    if bad_values:
        raise TypeError(
            f"{fn}: sd: expected a dict of str to tensors; these entries are not: "
            f"{', '.join(repr(k) for k in bad_values[:10])}"
        )
    keys, leaves, spec = _keyed_leaves(fn, like)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    problems = [f"missing key {k!r}" for k in wanted if k not in sd]
    problems += [f"unexpected key {k!r}" for k in sd if k not in wanted]
    for k, t in wanted.items():
        v = sd.get(k)
        if v is None:
            continue
        if v.shape != t.shape:
            problems.append(f"{k!r}: expected shape {tuple(t.shape)}, got {tuple(v.shape)}")
        if v.dtype != t.dtype:
            problems.append(f"{k!r}: expected {t.dtype}, got {v.dtype}")
    if problems:
        shown = "; ".join(problems[:20])
        more = f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"{fn}: the state dict does not match the tree ({len(problems)} problems): "
            f"{shown}{more}"
        )
    out: list[Any] = []
    with torch.no_grad():
        for key, t in zip(keys, leaves):
            out.append(None if key is None else torch.empty_like(t).copy_(sd[key]))
    return _tree.unflatten(spec, out)


def masters_state_dict(masters: Any) -> dict[str, torch.Tensor]:
    """The fp32 masters as a plain CPU ``state_dict`` for an fp32 copy of the model.

    With masters made from ``dict(model.named_parameters())`` the keys are the
    parameter names, so ``fp32_model.load_state_dict(sd, strict=False)`` takes them
    (``strict=False`` because buffers are not masters). The masters are never
    trapped in mpfunc's format.
    """
    return {k: v.detach().cpu().clone() for k, v in state_dict(masters).items()}


def save(path: PathLike, tree: Any) -> None:
    """Saves ``tree``'s state dict to ``path`` atomically, in torch's own format.

    Tensors are copied to the host first (XLA and CUDA tensors included). The file is
    written to a temporary name in the same folder, flushed and fsynced, then
    renamed over ``path``, so a crash mid-save never destroys the previous checkpoint.

    Raises:
      TypeError, ValueError: as ``state_dict``; nothing is written then.
      OSError: the folder is not writable (the previous file, if any, is intact).
    """
    sd = {k: v.detach().cpu() for k, v in state_dict(tree).items()}
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".mpfunc-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load(path: PathLike, like: Any) -> Any:
    """Loads a checkpoint written by ``save`` into a new tree shaped like ``like``.

    The file is read with ``torch.load(weights_only=True)``: it can hold tensors and
    plain containers only, and no code in it ever runs. Values are restored to
    ``like``'s devices (XLA included). ``like`` is not modified.

    Raises:
      ValueError: the file is not a readable checkpoint (truncated, random bytes, or
        holding objects other than tensors), or it belongs to another tree (every
        missing/unexpected key and shape/dtype mismatch is listed).
      FileNotFoundError: ``path`` does not exist.
    """
    fn = "load"
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{fn}: {path!r} does not exist")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types here: say what it means
        raise ValueError(
            f"{fn}: {path!r} is not a readable mpfunc checkpoint (truncated, corrupt, or "
            f"holding objects other than tensors, which are refused): {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if not isinstance(sd, dict):
        raise ValueError(
            f"{fn}: {path!r}: expected a dict of str to tensors, got {type(sd).__name__}"
        )
    try:
        return load_state_dict(like, sd)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{fn}: {path!r}: {str(e).removeprefix('load_state_dict: ')}") from None
