"""``MasterOptimizer``: mpfunc's mixed-precision step as a real ``torch.optim.Optimizer``.

Trainers, schedulers and ``GradScaler`` speak torch.optim's protocol: ``param_groups``
(dicts of hyperparameters that schedulers rewrite), ``step()``, ``zero_grad()``,
``state_dict()``. ``MasterOptimizer`` keeps that protocol over the model's own
low-precision parameters and, underneath, runs mpfunc's transforms on fp32 masters:

* the masters are a flat list in torch's parameter order (index ``j`` of
  ``state_dict()["state"]`` is leaf ``j``), one label per param group;
* each group's hyperparameters are read at every ``step()`` and built into an mpfunc
  optimizer with the factory given (``mpfunc.adamw``, ...); the optimizers of all
  groups run as one ``partition`` over the masters. A group is rebuilt only when one
  of its values changed. On lazy devices (XLA) the lr is a 0-d tensor on the device,
  refreshed from the group's float by a host-to-device copy, so a scheduler's new lr
  never enters a traced graph as a constant;
* ``self.state[param]`` holds the very tensors the step writes (moments, step count,
  and the fp32 ``"master"``), so torch's ``state_dict()`` is used as is. It is the live
  state, as in torch.optim: an entry written in place or replaced is what the next step
  uses (``_take_up``), and an emptied entry starts that param afresh.
"""

from __future__ import annotations

import copy
import inspect
import operator
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import required

from mpfunc.backends import _plan
from mpfunc.core import _checks, _dtensor
from mpfunc.core._checks import Side
from mpfunc.core._optimizer import Optimizer
from mpfunc.optim._adam import adam, adamw
from mpfunc.optim._migrate import native_factory
from mpfunc.parallel import _sharding
from mpfunc.strategies import _remainder
from mpfunc.strategies._strategy import STRATEGIES
from mpfunc.transforms import _step_in_backward
from mpfunc.transforms._apply_update import prepared_update_
from mpfunc.transforms._init_master import check_params, init_master
from mpfunc.transforms._partition import partition

__all__ = ["MasterOptimizer", "NoGradWarning"]

_MASTER = "master"


def _master_entries(m: Any) -> dict[str, torch.Tensor]:
    """A master's tensors as ``state_dict()`` holds them: ``{"master": fp32 tensor}`` for
    the ``"fp32"`` strategy; for the others, the unit's buffers by field name
    (``"remainder"``, ``"compensation"``, ``"seed"``), never the param itself, which the
    model's own ``state_dict`` holds."""
    if isinstance(m, torch.Tensor):
        return {_MASTER: m}
    return {name: t for name, t in m._asdict().items() if name != "param"}


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a hyperparameter's value, to tell whether it changed.
    A tensor stands for itself (its value is read by the step, never by the host)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


_TAKE_UP_HINT = (
    "MasterOptimizer.state is the live state, as in torch.optim: replace an entry with a "
    "tensor like it (torch.zeros_like(t)), write into it (t.zero_()), or set "
    "opt.state[p] = {} to start that param afresh"
)


def _check_like(fn: str, path: str, held: Any, new: Any) -> None:
    """Raises unless ``new`` can stand in for ``held`` in the state: a tensor of its dtype,
    shape and device; a NamedTuple (8-bit moments) of its type, field by field."""
    if new is held:
        return
    if isinstance(held, tuple) and type(new) is type(held):
        for name, a, b in zip(held._fields, held, new):  # type: ignore[attr-defined]
            _check_like(fn, f"{path}.{name}", a, b)
        return
    if not isinstance(held, torch.Tensor):  # pragma: no cover - state holds tensors
        raise TypeError(f"{fn}: at {path!r}: cannot replace {_checks.describe(held)}")
    if not isinstance(new, torch.Tensor) or new.layout != torch.strided:
        _checks.fail(TypeError, fn, path, f"{_checks.describe(held)} (like the one it replaces)",
                     _checks.describe(new), _TAKE_UP_HINT)  # fmt: skip
    if (new.dtype, new.shape, new.device) != (held.dtype, held.shape, held.device):
        _checks.fail(ValueError, fn, path, f"{_checks.describe(held)} (like the one it replaces)",
                     _checks.describe(new), _TAKE_UP_HINT)  # fmt: skip


def _entry(state: Any, j: int, master: Any) -> dict[str, Any]:
    """Param ``j``'s entry of ``opt.state`` (torch's format): its tensor of each field that
    ``state`` (its group's mpfunc state) uses, and its master's."""
    entry = {name: getattr(state, name)[j] for name in state._fields
             if getattr(state, name) is not None}  # fmt: skip
    entry.update(_master_entries(master))
    return entry


class NoGradWarning(UserWarning):
    """``MasterOptimizer.step()`` found no grad on any param it trains (once per optimizer)."""


_NO_GRAD = (
    "MasterOptimizer.step: no param this optimizer trains has a .grad, so nothing was stepped "
    "(as in torch.optim). The usual cause: the model was moved with .to(device)/.cuda() after "
    "the optimizer was made, which gives it new Parameter objects the optimizer does not hold "
    "(make the optimizer after moving the model); else backward() was not called, or every "
    "param is frozen. Warned once per optimizer"
)


def _name_of(names: list[str], k: int) -> str:
    """Param ``k`` of a group by its name (``param_names``) or its place in the group."""
    return names[k] if 0 <= k < len(names) else f"params.{k}"


def _in_param_terms(text: str, name: Callable[[int], str]) -> str:
    """An error of ``init_master`` or an optimizer's ``init`` over the optimizer's flat list
    of params, said of the param (``name(k)``: param ``k`` of that list by its name) and with
    a param group as the way out where the functional message offers a partition."""
    text = re.sub(r"'(?:params|masters)\.(\d+)'", lambda m: repr(name(int(m.group(1)))), text)
    text = re.sub(r"strategy\.(\d+):", lambda m: f"strategy({name(int(m.group(1)))!r}):", text)
    return re.sub(
        r"Keep small leaves in fp32 state: mpfunc\.partition.*$",
        "Keep small params in fp32 state, in a param group of their own: "
        "MasterOptimizer([{'params': big}, {'params': small, 'state_dtype': None}], "
        "...) with small = [p for p in params if p.numel() < 4096]",
        text,
    )


def _version(m: Any) -> int:
    """An "fp32" master's version counter; -1 for none or another strategy's unit."""
    return m._version if isinstance(m, torch.Tensor) else -1


def _from_torch_entry(entry: Mapping[str, Any], live: Mapping[str, Any], m: Any) -> dict[str, Any]:
    """A torch.optim state entry as this optimizer's: its tensors as saved (``None``
    values, such as SGD's unused ``momentum_buffer``, left out), the master made from the
    model's param (``m``: torch.optim keeps none), and, where torch keeps no step count
    (SGD), 1 once the param has state (its first step is behind it) else 0."""
    out = {k: v for k, v in entry.items() if v is not None}
    out.update(_master_entries(m))
    if "step" in live and "step" not in out:
        t = live["step"]
        stepped = any(isinstance(v, torch.Tensor) for v in out.values())
        out["step"] = torch.full_like(t, 1.0 if stepped else 0.0)
    return out


def _untied(
    fn: str, where: str, entry: Mapping[str, Any], param: torch.Tensor
) -> tuple[dict[str, Any], torch.Tensor]:
    """A ``"remainder"`` entry saved before tie bits (a ``remainder`` but no ``ties``) as
    today's: the master its remainder and the model's param held (ties away from zero)
    split again. Returns the entry and the param's new value (nearest even)."""
    r = entry.get("remainder")
    if not isinstance(r, torch.Tensor) or r.dtype != torch.int16 or r.shape != param.shape:
        _checks.fail(
            ValueError, fn, f"{where}['remainder']",
            f"torch.int16 tensor of shape {tuple(param.shape)}", _checks.describe(r),
        )  # fmt: skip
    master = _remainder.join_ties_away(param.detach().cpu(), r.detach().cpu())
    rounded, remainder, ties = _remainder.split(master)
    return {**entry, "remainder": remainder, "ties": ties}, rounded


def _extend(state: Any, n: int) -> None:
    """Appends ``n`` empty (``None``) slots to every field of an elementwise state whose
    trees are flat lists: the new group's leaves belong to another label."""
    for value in state:
        if isinstance(value, list):
            value.extend([None] * n)
        elif value is not None:  # pragma: no cover - every mpfunc state field is a list here
            raise TypeError(f"MasterOptimizer: unexpected state field {_checks.describe(value)}")


def _same_kind(live: Any, saved: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The (live, saved) tensor pairs of one state entry when ``saved`` is what ``live`` is:
    a tensor of its dtype and shape, or the same NamedTuple of such tensors (8-bit and 4-bit
    moments: codes and scales); else ``None``."""

    def same(t: Any, s: Any) -> bool:
        # A DTensor pairs with a DTensor of its placement (a whole tensor saved by one
        # process has no one place in a rank's shard: the copy failed after others).
        return (
            isinstance(s, torch.Tensor)
            and s.dtype == t.dtype
            and s.shape == t.shape
            and _dtensor.same_sharding(t, s) is None
        )

    if isinstance(live, torch.Tensor):
        return [(live, saved)] if same(live, saved) else None
    unit = isinstance(live, tuple) and type(saved) is type(live) and len(saved) == len(live)
    if unit and all(isinstance(t, torch.Tensor) and same(t, s) for t, s in zip(live, saved)):
        return list(zip(live, saved))
    return None


class MasterOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that keeps fp32 masters for low-precision params.

    ``step()`` reads each param's ``.grad`` in the param's dtype (bf16, fp16, fp32),
    upcasts it, runs the mpfunc optimizer's update on the fp32 master, and rounds the
    master back into the param (nearest-even, as ``Tensor.to``). Everything torch.optim
    users rely on works: param groups with their own hyperparameters, every
    ``torch.optim.lr_scheduler`` (OneCycleLR's momentum cycling included), GradScaler,
    ``state_dict()``/``load_state_dict()`` in torch's format, HF ``Trainer``.

    Args:
      params: what torch.optim takes: an iterable of tensors, of ``(name, tensor)``
        pairs (torch >= 2.6), or of param-group dicts whose keys override ``defaults``.
        Params with ``requires_grad=False`` get no master and no state; one that later
        receives a grad gets both at that step, as torch.optim makes state lazily.
      opt: the mpfunc optimizer *factory*: ``mpfunc.adamw`` (default), ``mpfunc.adam``,
        ``mpfunc.sgd``, ``mpfunc.lion``, or a ``functools.partial`` of one. Its keyword
        arguments are the groups' keys (``lr``, ``betas``, ``weight_decay``, ...).
      strategy: how masters are kept, as in ``init_master``: ``"fp32"`` (an fp32 copy
        of each param), ``"remainder"``, ``"kahan"``, ``"stochastic"`` or ``"none"``, or a
        function ``(name, param) -> name`` for a model that mixes dtypes (``lambda name,
        p: "remainder" if p.dtype == torch.bfloat16 else "none"``: an fp32 norm is its own
        exact master). ``name`` is the param's name where the groups give names
        (``named_parameters()``), else ``"param_groups[i].params[k]"``. ``state_dict()``
        holds each master's tensors: ``"master"`` for ``"fp32"``, else the strategy's
        buffer (``"remainder"``, ...); the param itself is the model's.
      **defaults: hyperparameters for every group, passed to ``opt``; the factory's own
        defaults fill the rest.

    Every ``step()`` reads each group's values. Changing ``lr`` (what schedulers do)
    costs nothing on CPU/CUDA and, on XLA, one host-to-device copy of a 0-d tensor: no
    recompile, no host read. Changing another value (OneCycleLR cycles ``betas[0]``)
    rebuilds that group's mpfunc optimizer, a few microseconds; on XLA the new value is
    a new scalar input of the same graph. A change that needs other state (``amsgrad``
    turned on, SGD momentum from 0) makes it as ``init`` does (zeros), one that no longer
    uses a field drops it, and a new ``state_dtype`` raises before anything is written.

    A param written outside the optimizer (``model.load_state_dict``, a broadcast)
    is noticed from its version counter: at the next step its master takes the new
    values, elementwise where they differ from the rounded master, so an unchanged
    element keeps its fp32 bits.

    ``opt.state`` is the live state, as in torch.optim: what the next ``step()`` uses and
    ``state_dict()`` saves. An entry written in place (``opt.state[p]["exp_avg"].zero_()``)
    or replaced by a tensor like it (``= torch.zeros_like(...)``) is taken up, and a
    ``"master"`` written so is rounded into its param; ``opt.state[p] = {}`` or
    ``opt.state.clear()`` starts those params afresh (step 0, zero moments, masters from
    the params). A replacement of another dtype, shape or device, or an entry with other
    keys, is refused before anything is written.

    ``torch.amp.GradScaler`` drives it through torch's ``_step_supports_amp_scaling``
    protocol: ``scaler.step(opt)`` hands the loss scale and a device-side ``found_inf``
    to ``step``, which divides the grads by the scale in fp32 and skips the update on the
    device (no host read, unlike plain optimizers under GradScaler). ``scaler.unscale_(opt)``
    before clipping works for bf16 and fp32 params; GradScaler itself refuses to unscale
    fp16 grads, so with fp16 params call ``scaler.step(opt)`` without ``unscale_`` (and
    clip after the step's upcast is not possible: use mpfunc's functional loop).

    Example::

      opt = mpfunc.MasterOptimizer(model.parameters(), mpfunc.adamw, lr=3e-4, weight_decay=0.1)
      sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-4, total_steps=1000)
      for x, y in loader:
          loss_fn(model(x), y).backward()
          opt.step()
          sched.step()
          opt.zero_grad()
    """

    # GradScaler passes the loss scale and found_inf as attributes (grad_scale, found_inf)
    # and calls step() directly, without reading found_inf on the host.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        opt: Callable[..., Optimizer] = adamw,
        *,
        strategy: str | Callable[[str, torch.Tensor], str] = "fp32",
        step_in_backward: bool = False,
        **defaults: Any,
    ) -> None:
        fn = "MasterOptimizer"
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"{fn}: step_in_backward: expected a bool, got "
                            f"{_checks.describe(step_in_backward)}")  # fmt: skip
        # The hooks of step_in_backward=True (_step_in_backward); None for the ordinary step.
        self._in_backward: _step_in_backward.Hooks | None = None
        self._factory, keys, full = self._check_factory(fn, opt, defaults)
        # A name for every param, or fn(name, param) -> name (a model that keeps its norms
        # in fp32 beside bf16 weights); each param's name is kept in self._kinds.
        self._strategy: str | Callable[[str, torch.Tensor], Any] = (
            strategy
            if callable(strategy)
            else _checks.choice(fn, "strategy", strategy, tuple(STRATEGIES))
        )
        self._kinds: list[Any] = []
        self._keys = keys
        # One slot per param, in torch's order (state_dict indices).
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        self._group_of: list[int] = []
        self._masters: list[torch.Tensor | None] = []
        self._labels: list[str | None] = []
        self._versions: list[int] = []
        # Each param's dtype when last in step with its master: a model converted since
        # (model.float()) holds the old rounding of its masters, widened, not new values.
        self._dtypes: dict[int, torch.dtype] = {}
        self._master_versions: list[int] = []  # of "fp32" masters: written through opt.state?
        # Params whose "fp32" master was put in place through opt.state: the param shows it
        # at the next step, after the checks (_round_written_masters).
        self._shown: set[int] = set()
        # The dict put in self.state[param] and its entries then, to notice what a user
        # replaced there (None: no master, no state).
        self._linked: list[tuple[dict[str, Any], tuple[str, ...], tuple[Any, ...]] | None] = []
        self._states: dict[str, Any] = {}  # label -> that group's mpfunc state
        self._built: dict[str, tuple[Any, Optimizer]] = {}  # label -> (values, optimizer)
        self._lr_dev: dict[tuple[str, torch.device], tuple[torch.Tensor, float]] = {}
        self._varying: set[str] = set()  # groups whose non-lr values change (XLA: foreach)
        self._opt: Optimizer | None = None  # the partition, rebuilt when a group changes
        self._warned_no_grad = False  # NoGradWarning: once per optimizer
        # Each group's "params" list and the params in it when added (_check_group_params).
        self._group_params: list[tuple[list[Any], tuple[Any, ...]]] = []
        super().__init__(params, full)
        if step_in_backward:
            self._in_backward = _step_in_backward.optimizer_hooks(self)

    @staticmethod
    def _check_factory(
        fn: str, opt: object, defaults: dict[str, Any]
    ) -> tuple[Callable[..., Optimizer], tuple[str, ...], dict[str, Any]]:
        if isinstance(opt, Optimizer):
            raise TypeError(
                f"{fn}: opt: expected an mpfunc optimizer factory such as mpfunc.adamw, got a "
                f"built {opt.name} optimizer, whose hyperparameters are fixed. Pass the factory "
                "and the values: MasterOptimizer(params, mpfunc.adamw, lr=3e-4, weight_decay=0.1)"
            )
        if isinstance(opt, type) and issubclass(opt, torch.optim.Optimizer):
            raise TypeError(
                f"{fn}: opt: expected an mpfunc optimizer factory such as mpfunc.adamw, got "
                f"{_checks.describe(opt)}. To migrate a built torch optimizer use "
                "MasterOptimizer.from_torch(torch_opt)"
            )
        if not callable(opt):
            raise TypeError(
                f"{fn}: opt: expected an mpfunc optimizer factory such as mpfunc.adamw, got "
                f"{_checks.describe(opt)}"
            )
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        sig = inspect.signature(opt)
        keys = tuple(n for n, p in sig.parameters.items() if p.kind in kinds)
        if "lr" not in keys:
            raise TypeError(f"{fn}: opt: expected a factory taking lr=, got {opt!r}{sig}")
        unknown = sorted(set(defaults) - set(keys))
        if unknown:
            raise TypeError(
                f"{fn}: expected hyperparameters of {getattr(opt, '__name__', opt)!s} "
                f"({', '.join(keys)}), got {', '.join(unknown)}"
            )
        full: dict[str, Any] = {}
        for name in keys:
            default = sig.parameters[name].default
            full[name] = required if default is inspect.Parameter.empty else default
        full.update(defaults)
        return opt, keys, full

    @classmethod
    def from_torch(
        cls,
        torch_opt: torch.optim.Optimizer,
        *,
        strategy: str | Callable[[str, torch.Tensor], str] = "fp32",
    ) -> MasterOptimizer:
        """A ``MasterOptimizer`` over the same param groups, with the same values, as a
        built ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (its state is not copied: its
        ``state_dict()`` loads with ``load_state_dict``)."""
        fn = "MasterOptimizer.from_torch"
        native = native_factory(fn, torch_opt)
        if native is None:
            raise TypeError(
                f"{fn}: torch_opt: expected torch.optim.Adam, AdamW or SGD, got "
                f"{type(torch_opt).__name__}: mpfunc has no native optimizer for it (the "
                "functional mpfunc.torch_optimizer runs any class, without schedulers)"
            )
        factory, keys = native
        for i, group in enumerate(torch_opt.param_groups):
            # torch >= 2.7's Adam takes decoupled_weight_decay per group: one optimizer
            # runs them all, so every group must do the same math.
            own = native_factory(fn, torch_opt, group)
            assert own is not None
            if i == 0:
                factory = own[0]
            elif own[0] is not factory:
                raise ValueError(
                    f"{fn}: torch_opt.param_groups[{i}]: expected the math of param_groups[0] "
                    f"(mpfunc.{factory.__name__}), got decoupled_weight_decay="
                    f"{group.get('decoupled_weight_decay')} (mpfunc.{own[0].__name__}): a "
                    "MasterOptimizer runs one optimizer. Use one decoupled_weight_decay, or "
                    "mpfunc.from_torch_optim (a partition, one optimizer per group)"
                )
        groups = []
        for group in torch_opt.param_groups:
            g = {k: group[k] for k in keys}
            g["params"] = list(group["params"])
            if "param_names" in group:
                g["params"] = list(zip(group["param_names"], group["params"]))
            groups.append(g)
        # Its defaults too, for the groups added later (add_param_group fills a group from
        # them): without them a new group took mpfunc's factory defaults, lr 1e-3 and no
        # momentum, where torch.optim gives the built values (found in review).
        defaults = {k: torch_opt.defaults[k] for k in keys if k in torch_opt.defaults}
        return cls(groups, factory, strategy=strategy, **defaults)

    # --- groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim's, then makes masters and state for the group's trainable params."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        i = len(self.param_groups) - 1
        label = str(i)
        names = group.get("param_names") or [
            f"param_groups[{i}].params[{k}]" for k in range(len(group["params"]))
        ]
        try:
            self._build(label, group)
            params = list(group["params"])
            kinds = [
                self._strategy(name, p) if callable(self._strategy) else self._strategy
                for name, p in zip(names, params)
            ]
            # Masters made over the whole flat list, so that each leaf's index (the
            # stochastic strategy's RNG stream) is its state_dict index.
            masters = init_master(
                [None] * len(self._params) + params,
                strategy=[None] * len(self._params) + kinds, trainable_only=True,
            )[len(self._params):]  # fmt: skip
            everything = [*self._params, *params]
            check_params(
                "MasterOptimizer", Side("params", everything, [
                    p if p.is_floating_point() else None for p in everything
                ]), None,
            )  # fmt: skip
            # The state too, before anything of the optimizer's changes (a leaf too small
            # for an 8-bit block is refused here), and the hooks' checks.
            made = self._built[label][1].init([None] * len(self._params) + masters)
            if self._in_backward is not None:
                for name, p in zip(names, params):
                    _step_in_backward.check_optimizer_param(name, p)
        except (TypeError, ValueError) as e:
            self.param_groups.pop()
            self._built.pop(label, None)  # the optimizer stays as it was before the call

            # init_master names a param by its index in the optimizer's flat list: say which.
            n_old = len(self._params)
            text = _in_param_terms(str(e), lambda k: _name_of(names, k - n_old))
            if not text.startswith("MasterOptimizer"):  # the hooks' checks say it already
                text = f"MasterOptimizer: param_groups[{i}]: {text}"
            raise type(e)(text) from e
        n_old, n = len(self._params), len(params)
        self._group_params.append((group["params"], tuple(group["params"])))
        self._kinds += kinds
        self._params += params
        self._names += list(names)
        self._group_of += [i] * n
        self._masters += masters
        self._labels += [None if m is None else label for m in masters]
        self._versions += [p._version for p in params]
        self._dtypes.update({n_old + k: p.dtype for k, p in enumerate(params)})
        self._master_versions += [_version(m) for m in masters]
        self._linked += [None] * n
        for state in self._states.values():
            _extend(state, n)
        self._states[label] = made
        for j in range(n_old, n_old + n):
            self._link(j)
        self._opt = None
        if self._in_backward is not None:
            for j in range(n_old, n_old + n):
                _step_in_backward.watch_optimizer_param(self, self._in_backward, j)

    def _link(self, j: int) -> None:
        """``self.state[param]``: the step's own tensors for param ``j`` (torch's format)."""
        p, m, label = self._params[j], self._masters[j], self._labels[j]
        if m is None or label is None:
            self.state.pop(p, None)
            self._linked[j] = None
            return
        entry = _entry(self._states[label], j, m)
        self.state[p] = entry
        self._linked[j] = (entry, tuple(entry), tuple(entry.values()))

    # --- opt.state, the live state --------------------------------------------------------

    def _take_up(self, fn: str) -> None:
        """Makes what the user wrote into ``self.state`` the state the step uses, as
        torch.optim does: a replaced entry (``state[p]["exp_avg"] = torch.zeros_like(...)``)
        becomes the tensor the step writes, and an entry emptied or removed
        (``state[p] = {}``, ``state.clear()``) starts that param afresh: step count 0, zero
        moments, its master made from the param as at the start. (Writes into an entry's
        tensor need nothing: they are the step's own tensors.)

        Every change is checked before any is taken: a replacement must be a tensor of the
        dtype, shape and device of the one it replaces; an entry keeps its keys. Costs one
        identity test per entry when nothing changed: no tensor is read.
        """
        state = self.state
        changed: list[tuple[int, dict[str, Any] | None]] = []
        for j, (p, linked) in enumerate(zip(self._params, self._linked)):
            if linked is None or self._untouched(j):
                continue  # no master: torch.optim makes state at the first grad too
            entry = state.get(p)
            _, keys, values = linked
            where = f"opt.state[{self._names[j]}]"
            if entry:
                if not isinstance(entry, dict) or set(entry) != set(keys):
                    _checks.fail(
                        ValueError, fn, where,
                        f"the keys {sorted(keys)} (or an empty dict, to start this param afresh)",
                        str(sorted(entry)) if isinstance(entry, dict) else _checks.describe(entry),
                        _TAKE_UP_HINT,
                    )  # fmt: skip
                for k, t in zip(keys, values):
                    _check_like(fn, f"{where}.{k}", t, entry[k])
            changed.append((j, entry or None))
        made = {j: self._made(j, fn) for j, entry in changed if entry is None}
        for j, entry in changed:
            if entry is None:
                self._adopt(j, made[j])  # a fresh master and state, linked anew
            else:
                self._replace(j, entry)

    def _untouched(self, j: int) -> bool:
        """Whether ``self.state`` holds param ``j``'s entry as linked: the same dict, with
        the same keys in the same order and the same objects (a replaced value keeps its
        key's place). One identity test per key; no tensor is read."""
        linked = self._linked[j]
        if linked is None:
            return True
        entry = self.state.get(self._params[j])
        held, keys, values = linked
        return (
            entry is held
            and tuple(entry) == keys
            and all(map(operator.is_, entry.values(), values))
        )

    def _replace(self, j: int, entry: dict[str, Any]) -> None:
        """Puts the entries of ``entry`` (checked) in place of the held ones for param ``j``."""
        label, linked = self._labels[j], self._linked[j]
        assert label is not None and linked is not None
        state = self._states[label]
        m: Any = self._masters[j]  # a tensor, or a strategy's unit (a NamedTuple)
        for k, old in zip(linked[1], linked[2]):
            new = entry[k]
            if new is old:
                continue
            if k in state._fields:
                getattr(state, k)[j] = new
            elif isinstance(m, torch.Tensor):  # the "fp32" strategy's master itself
                m = new
                # The param shows it at the step, once every check has passed (a refused
                # step or load wrote it before: found in review): _round_written_masters.
                self._shown.add(j)
            else:  # a strategy's buffer (a remainder, a compensation, a seed)
                m = m._replace(**{k: new})
        self._masters[j] = m
        self._master_versions[j] = _version(m)
        # Linked anew from the held state, which now holds the user's tensors: the fields
        # are the group's current ones (a restate in this step may have added or dropped
        # one since the user's entry was read).
        self._link(j)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``state_dict()``, of the state the next step uses (writes into
        ``self.state`` taken up first)."""
        self._check_group_params("MasterOptimizer.state_dict")
        self._take_up("MasterOptimizer.state_dict")
        self._round_written_masters(replaced_only=True)  # such a master shows now
        return super().state_dict()

    def _lr_on_device(self, label: str, device: torch.device, value: float) -> torch.Tensor:
        """The group's lr as a 0-d fp32 tensor on a lazy device, written at every step from
        a host copy: new data for the same graph, never a traced constant.

        The value travels as a 1-element 1-d tensor: torch_xla turns a 0-d host tensor into
        a scalar, baking 0.0 and 1.0 into the graph as constants and merging inputs of
        equal value (an lr equal to weight_decay), each a new graph to compile. It is
        written even when unchanged, so every step traces the same graph.
        """
        with torch.no_grad():
            fresh = torch.tensor([value], dtype=torch.float32).to(device).reshape(())
            held = self._lr_dev.get((label, device))
            if held is None:
                t = fresh.clone()
            else:
                t = held[0]
                t.copy_(fresh)
        self._lr_dev[(label, device)] = (t, value)
        return t

    def _check_group_params(self, fn: str = "MasterOptimizer.step") -> None:
        """The groups and their ``"params"`` lists are those the optimizer made masters for:
        a param appended to ``param_groups[i]["params"]`` or put in place of another
        (which torch.optim would train), or a group appended or removed by hand, was not
        trained, with no word (a replaced param: the old one went on training). Costs one
        identity test per param."""
        held = self._group_params
        if len(self.param_groups) != len(held):
            raise ValueError(
                f"{fn}: param_groups: expected the {len(held)} groups this "
                f"optimizer holds, got {len(self.param_groups)}. Add a group with "
                f"opt.add_param_group(...); a group cannot be removed (make a new optimizer)"
            )
        for i, (group, (ps, made)) in enumerate(zip(self.param_groups, held)):
            if group["params"] is not ps or len(ps) != len(made):
                got = f"a list of {len(group['params'])}" + (
                    " (the same list, changed)" if group["params"] is ps else " (another list)"
                )
            elif not all(map(operator.is_, ps, made)):
                k = next(k for k, (a, b) in enumerate(zip(ps, made)) if a is not b)
                got = f"another tensor at params[{k}] than the param it was made with"
            else:
                continue
            raise ValueError(
                f"{fn}: param_groups[{i}]['params']: expected the "
                f"{len(made)} params the group was made with, got {got}: masters and state "
                f"are made when a group is added. Add params with "
                f"opt.add_param_group({{'params': [...]}}) or make a new optimizer"
            )

    def _build(self, label: str, group: Mapping[str, Any]) -> bool:
        """Builds the group's mpfunc optimizer from its current values, if they changed.
        Returns whether it was rebuilt."""
        values = {k: group[k] for k in self._keys}
        lr = values["lr"]
        params = group["params"]
        if params and _plan.is_lazy(params[0].device) and not isinstance(lr, torch.Tensor):
            lr = _checks.real(f"MasterOptimizer: param_groups[{label}]", "lr", lr, ge=0.0)
            values["lr"] = self._lr_on_device(label, params[0].device, lr)
        key = tuple(_freeze(v) for v in values.values())
        held = self._built.get(label)
        if held is not None and held[0] == key:
            return False
        lazy = bool(params) and _plan.is_lazy(params[0].device)
        if held is not None and lazy:
            # A value other than the lr changes during training (OneCycleLR's betas): the
            # one-node XLA kernel bakes hyperparameters into its computation, which would
            # recompile at every new value; the foreach path takes them as graph data.
            self._varying.add(label)
        build = dict(values)
        if label in self._varying and build.get("impl") == "auto":
            build["impl"] = "foreach"
        built = self._factory(**build)
        if held is not None:
            self._restate(label, held[0], key, built)
        self._built[label] = (key, built)
        return True

    def _restate(self, label: str, held: tuple[Any, ...], key: tuple[Any, ...], built: Any) -> None:
        """The group's state after a value that decides which state it keeps changed
        mid-run (torch's habit: ``param_groups[i]["momentum"] = 0.9``, ``["amsgrad"] =
        True``). A field the new values use and the state lacks is made as ``init`` makes
        it, zeros (SGD's momentum buffer then starts from the next grad, AMSGrad's running
        maximum from the next second moment); a field they no longer use is dropped, as a
        fresh optimizer with these values would keep none. A new ``state_dtype`` is refused
        before anything is written: the moments stay in the format they were made in."""
        if all(a == b for k, a, b in zip(self._keys, held, key) if k != "lr"):
            return  # the lr alone (a scheduler's every step): the state is the same
        state = self._states.get(label)
        if state is None:
            return  # the group is being added: its state is made from these values
        if "state_dtype" in self._keys:
            i = self._keys.index("state_dtype")
            if held[i] != key[i]:
                raise ValueError(
                    f"state_dtype: expected {held[i]} (the format this group's moments were "
                    f"made in), got {key[i]}. Moments are not converted mid-run: set it "
                    f"back, or make the optimizer with the new state_dtype from the start"
                )
        layout = built.init([None] * len(self._params))
        dampening = dict(zip(self._keys, key)).get("dampening", 0)
        changes: dict[str, Any] = {}
        fresh = None
        for name in state._fields:
            want = getattr(layout, name, None) is not None
            have = getattr(state, name) is not None
            if want and not have:
                if name == "momentum_buffer" and dampening:
                    raise ValueError(
                        f"momentum: expected it switched on with dampening=0, got dampening="
                        f"{dampening}: torch.optim starts a new buffer as the next grad, and "
                        f"mpfunc's step tells a buffer's first step by the step count, which "
                        f"is past it. Set the momentum from the start (or dampening to 0)"
                    )
                if fresh is None:
                    fresh = built.init(
                        [m if lab == label else None for m, lab in zip(self._masters, self._labels)]
                    )
                changes[name] = getattr(fresh, name)
            elif have and not want:
                changes[name] = None
        if changes:
            self._states[label] = state._replace(**changes)
            for j, lab in enumerate(self._labels):
                # An entry the user emptied or replaced is left for ``_take_up`` (later in
                # this step), which starts it afresh or takes its tensors: relinked now, it
                # was lost (``opt.state.clear()`` and ``amsgrad = True`` before one step
                # went on from the old count and moments; found in review).
                if lab == label and self._untouched(j):
                    self._link(j)

    def _optimizer(self) -> Optimizer:
        """The partition of every group's optimizer, rebuilt when a group's values changed."""
        self._check_group_params()
        changed = False
        for i, group in enumerate(self.param_groups):
            try:
                changed |= self._build(str(i), group)
            except (TypeError, ValueError) as e:
                raise type(e)(f"MasterOptimizer.step: param_groups[{i}]: {e}") from e
        if changed or self._opt is None:
            opts = {label: built for label, (_, built) in self._built.items()}
            self._opt = partition(opts, self._labels)
        return self._opt

    # --- the step -------------------------------------------------------------------------

    def _made(self, j: int, fn: str = "MasterOptimizer.step") -> tuple[Any, Any]:
        """A master for param ``j`` (from the param) and its group's fresh state, made
        aside: nothing of the optimizer's is written. A param they refuse (a frozen param
        too small for an 8-bit block, trained now) is named as ``add_param_group`` names
        it, in ``fn``'s error."""
        p, label = self._params[j], str(self._group_of[j])
        try:
            m = init_master([None] * j + [p], strategy=[None] * j + [self._kinds[j]])[j]
            fresh = self._built[label][1].init(
                [m if k == j else None for k in range(len(self._params))]
            )
        except (TypeError, ValueError) as e:
            text = _in_param_terms(str(e), lambda k: _name_of(self._names, k))
            group = f"param_groups[{self._group_of[j]}]"
            raise type(e)(f"{fn}: {group}: {text}") from e
        return m, fresh

    def _adopt(
        self, j: int, made: tuple[Any, Any] | None = None, fn: str = "MasterOptimizer.step"
    ) -> None:
        """Master and state for a param that had none (frozen when added) and now has a
        grad: made now (or ``made``, from ``_made(j)``), as torch.optim makes its state at
        a param's first step."""
        p, label = self._params[j], str(self._group_of[j])
        m, fresh = self._made(j, fn) if made is None else made
        self._masters[j], self._labels[j] = m, label
        self._versions[j] = p._version
        self._dtypes[j] = p.dtype
        self._master_versions[j] = _version(m)
        state = self._states[label]
        for name in state._fields:
            field = getattr(state, name)
            if field is not None:
                field[j] = getattr(fresh, name)[j]
        self._link(j)
        self._opt = None

    def _round_written_masters(self, *, replaced_only: bool = False) -> None:
        """An "fp32" master written in place (``opt.state[p]["master"].mul_(2)``, a load)
        while its param was not is rounded into the param now: the step takes a param that
        differs from its master's rounding as the truth, and would undo the write. (A
        param written too wins, as a write to the model does.) A master put in place
        through ``opt.state`` (``_shown``) shows in its param whatever was written;
        ``replaced_only``: those alone (``state_dict()``, which writes no other param)."""
        shown, self._shown = self._shown, set()
        for j, (p, m) in enumerate(zip(self._params, self._masters)):
            if not isinstance(m, torch.Tensor):
                continue
            if j not in shown and (replaced_only or m._version == self._master_versions[j]):
                continue
            # A master put in place through opt.state (``shown``) wins over a param write
            # too, as the user's latest word on that param.
            if j in shown or p._version == self._versions[j]:
                with torch.no_grad(), _sharding.kept([p]):
                    p.detach().copy_(m)
                self._versions[j] = p._version
            self._master_versions[j] = m._version

    def _resync(self) -> None:
        """Masters of params written outside the optimizer take the params' new values,
        elementwise where the param differs from the rounded master (on the device).

        A param whose dtype changed since (``model.float()``; the param keeps its version
        counter) holds the master's rounding to the old dtype, converted: those elements
        were not written, so the master stays and the param shows it again, its low bits
        back (the step would otherwise take the widened rounding as a write)."""
        dtypes = self._dtypes
        for j, (p, m) in enumerate(zip(self._params, self._masters)):
            if not isinstance(m, torch.Tensor):
                continue  # (other strategies keep the param itself as the master's face)
            old = dtypes.get(j, p.dtype)
            if p._version == self._versions[j] and p.dtype is old:
                continue
            with torch.no_grad():
                p_ = p.detach()
                same = m.to(p_.dtype) == p_
                if p_.dtype is not old:
                    kept = m.to(old).to(p_.dtype) == p_
                    same |= kept
                    with _sharding.kept([p]):
                        p_.copy_(torch.where(kept, m.to(p_.dtype), p_))
                m.copy_(torch.where(same, m, p_.to(m.dtype)))
            self._versions[j] = p._version
            dtypes[j] = p_.dtype

    # Under torch.compile the step runs eagerly (a graph break), as its bookkeeping is
    # Python state that dynamo cannot trace (it refused the first attribute write).
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        skip: torch.Tensor | None = None,
    ) -> Any:
        """One mixed-precision step over every param that has a ``.grad``.

        Inside a function compiled with ``torch.compile`` it runs eagerly (a graph
        break); for a compiled step use the functional transforms.

        Args:
          closure: as in torch.optim: re-evaluates the model and returns the loss.
          skip: ``None`` or a 0-d bool tensor; where true (on the device, never read
            by the host) masters, state and params stay bit-identical.

        Returns:
          The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():  # type: ignore[no-untyped-call]
                loss = closure()
        fn = "MasterOptimizer.step"
        skip = _checks.zero_d_bool(fn, "skip", skip, "e.g. ~mpfunc.all_finite(grads)")
        if self._in_backward is not None:  # the leaves stepped in backward: end the step
            _step_in_backward.optimizer_step(self, skip)
            return loss
        # Set by GradScaler.step (torch's _step_supports_amp_scaling protocol).
        scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        opt = self._optimizer()
        # Params frozen when added and trained now: all made before any is taken, and
        # before the user's writes into opt.state are (a refusal here wrote nothing).
        pending = [
            j for j, (p, m) in enumerate(zip(self._params, self._masters))
            if m is None and p.grad is not None
        ]  # fmt: skip
        made = {j: self._made(j, fn) for j in pending}
        self._take_up(fn)
        for j in pending:
            self._adopt(j, made[j])
        if self._opt is None:
            opt = self._optimizer()
        if found_inf is not None:
            inf = found_inf != 0
            skip = inf if skip is None else torch.logical_or(skip, inf.to(skip.device))
        grads = [None if m is None else p.grad for p, m in zip(self._params, self._masters)]
        if all(g is None for g in grads):
            self._round_written_masters()
            self._resync()
            self._master_versions = [_version(m) for m in self._masters]
            if not self._warned_no_grad and any(m is not None for m in self._masters):
                self._warned_no_grad = True
                warnings.warn(_NO_GRAD, NoGradWarning, stacklevel=3)  # torch wraps step
            return loss  # no param has a grad: nothing to step, as in torch.optim
        # One pass: grads upcast (and unscaled) inside the step, params written back. Every
        # check first; only then are the masters of params written outside refreshed (a
        # refused step had written them, and a param whose dtype changed: found in review).
        try:
            run = prepared_update_(
                "apply_update_", self._masters, grads, self._states, opt, skip, self._params,
                scale,
            )  # fmt: skip
        except (TypeError, ValueError) as e:  # checked before any write: say which param
            raise type(e)(f"MasterOptimizer.step: {self._named(str(e))}") from e
        self._round_written_masters()
        self._resync()
        run()
        self._versions = [p._version for p in self._params]
        self._master_versions = [_version(m) for m in self._masters]
        return loss

    def _group_values(self) -> list[tuple[Any, ...]]:
        """Each group's hyperparameters as ``_build`` tells them apart (``_freeze``), to
        notice a change between the backward and ``step()`` (step_in_backward=True)."""
        return [tuple(_freeze(g[k]) for k in self._keys) for g in self.param_groups]

    def _named(self, text: str) -> str:
        """An error of the step's tree call with each leaf path ``'masters.5'`` (also
        ``params``, ``grads``) followed by the param's name."""

        def name(m: re.Match[str]) -> str:
            j = int(m.group(2))
            return (
                f"{m.group(0)} (param {self._names[j]!r})" if j < len(self._names) else m.group(0)
            )

        return re.sub(r"'(masters|params|grads)\.(\d+)'", name, text)

    # --- copies ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Everything, for ``copy.deepcopy`` (of the model and optimizer together) and
        pickling: torch.optim's keeps only ``defaults``, ``state`` and ``param_groups``,
        which left a copy without its masters. The built optimizers are left out (they
        close over this optimizer's lists) and rebuilt at the copy's next step."""
        if self._in_backward is not None:
            raise TypeError(
                "MasterOptimizer(step_in_backward=True): cannot be copied or pickled, its "
                "hooks live on the params. Save opt.state_dict() and load it into a new "
                "MasterOptimizer over the copied model"
            )
        state = dict(self.__dict__)
        state["_opt"] = None
        state["_built"] = {}
        # An LR scheduler wraps ``step`` in an instance attribute that holds a weak reference
        # to THIS optimizer: copied, the copy's step() would step the original.
        state.pop("step", None)
        # Writes not yet taken up (a param written outside, a master through opt.state):
        # the copy's tensors have fresh version counters, so they are carried as flags.
        state["_pending"] = (
            [p._version != v for p, v in zip(self._params, self._versions)],
            [_version(m) != v for m, v in zip(self._masters, self._master_versions)],
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pending = state.pop("_pending", None)
        state.setdefault("_shown", set())  # (a copy pickled before it existed)
        self.__dict__.update(state)
        params, masters = pending or ([False] * len(self._params), [False] * len(self._masters))
        # A copy's params and masters are new tensors with their own version counters; a
        # pending write stays pending (a recorded version the counter does not hold; a
        # unit's -1 is never pending).
        self._versions = [p._version - w for p, w in zip(self._params, params)]
        self._master_versions = [_version(m) - w for m, w in zip(self._masters, masters)]

    # --- step_in_backward=True ---------------------------------------------------------------

    def _step_leaf(self, j: int, p: torch.Tensor) -> None:
        """Param ``j``'s hook (step_in_backward=True): steps that leaf alone."""
        _step_in_backward.optimizer_leaf(self, j, p)

    def close(self) -> None:
        """Removes the hooks of ``step_in_backward=True`` from the params (idempotent; also
        done when the optimizer is garbage-collected). After it, ``step()`` steps the grads
        a backward left, leaf by leaf."""
        if self._in_backward is not None:
            self._in_backward.remove()

    def __enter__(self) -> MasterOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- checkpoints ----------------------------------------------------------------------

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a ``state_dict()`` of a MasterOptimizer over the same param groups, or of
        the ``torch.optim.Adam``, ``AdamW`` or ``SGD`` the run used before (migrating a
        checkpoint): its moments and step counts are taken as they are (fp32 state only),
        each master is made from the model's param as it stands (load the model's weights
        first; with bf16 params the fp32 low bits of the old run are not in the file), and
        mpfunc's own group keys (``impl``, ``state_dtype``) keep this optimizer's values.

        Everything is checked first (groups, sizes, every state entry's keys, shapes and
        dtypes; devices may differ), then the values are copied into the optimizer's own
        tensors, so a resumed run continues bit for bit. Unlike torch.optim, floating
        state is never cast to the param's dtype: moments and masters stay fp32. The
        groups' hyperparameters (and a scheduler's keys) are restored as torch does.

        Raises:
          TypeError, ValueError: the dict is not such a state dict, or does not fit.
        """
        fn = "MasterOptimizer.load_state_dict"
        for hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        self._take_up(fn)  # the values are loaded into the state the next step uses
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError(
                f"{fn}: expected a dict with 'state' and 'param_groups' (from state_dict()), "
                f"got {_checks.describe(state_dict)}"
            )
        saved_groups = copy.deepcopy(list(state_dict["param_groups"]))
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{fn}: param_groups: expected {len(self.param_groups)} groups, got "
                f"{len(saved_groups)}"
            )
        foreign = self._torch_optim_format(fn, saved_groups, saved_state)
        index: dict[Any, int] = {}
        start = 0
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            n = len(group["params"])
            if len(saved["params"]) != n:
                raise ValueError(
                    f"{fn}: param_groups[{i}]: expected {n} params, got {len(saved['params'])}"
                )
            names, saved_names = group.get("param_names"), saved.get("param_names")
            if names is not None and saved_names is not None and list(names) != list(saved_names):
                # Entries are taken by position, as torch.optim takes them, and here they hold
                # masters: a param under another's name would get its weights.
                k = next((k for k, (a, b) in enumerate(zip(names, saved_names)) if a != b), 0)
                raise ValueError(
                    f"{fn}: param_groups[{i}].param_names: expected the names of this "
                    f"optimizer's params in its order (at {k}: {names[k]!r}), got "
                    f"{saved_names[k]!r} there. Build the MasterOptimizer over the params in "
                    "the saved order (state is taken by position, and holds the masters)"
                )
            index.update({k: start + pos for pos, k in enumerate(saved["params"])})
            start += n
            self._check_values(f"{fn}: param_groups[{i}]", i, saved)
        unknown = [k for k in saved_state if k not in index]
        if unknown:
            raise ValueError(f"{fn}: state: expected param indices {sorted(index.values())}, got "
                             f"{unknown[:5]}")  # fmt: skip
        # Params that gained state after a freeze: their masters and states are made aside,
        # checked with the others, and taken only once everything passed.
        made: dict[int, tuple[Any, Any]] = {}
        for k, entry in saved_state.items():
            j = index[k]
            if entry and (self._masters[j] is None or foreign):
                self._built_for_load(fn)  # (from torch.optim: masters made from the params)
                made[j] = self._made(j, fn)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        rewrites: list[tuple[torch.Tensor, torch.Tensor]] = []
        saved_at = {j: k for k, j in index.items()}
        fresh: list[int] = []
        for j, p in enumerate(self._params):
            live: dict[str, Any] | None
            if j in made:
                live = _entry(made[j][1], j, made[j][0])
            else:
                live = self.state.get(p) if self._masters[j] is not None else None
            entry = saved_state.get(saved_at[j]) or {}
            where = f"state[{saved_at[j]}] ({self._names[j]})"
            if foreign and entry and live:
                entry = _from_torch_entry(entry, live, made[j][0])
            if not live:
                if entry:
                    raise ValueError(f"{fn}: {where}: expected no state (a frozen param), got "
                                     f"{sorted(entry)}")  # fmt: skip
                continue
            if not entry:
                # No state saved for it (no grad yet in that run, frozen then, plain SGD's
                # empty state): as torch.optim, it starts afresh at its next step.
                fresh.append(j)
                continue
            if set(live) - set(entry) == {"ties"} and set(entry) <= set(live):
                # A "remainder" entry saved before tie bits: its pair with the model's param
                # (loaded first) is the master; split it again by today's rule.
                entry, rounded = _untied(fn, where, entry, self._params[j])
                rewrites.append((self._params[j], rounded))
            if set(entry) != set(live):
                raise ValueError(
                    f"{fn}: {where}: expected the keys {sorted(live)}, got {sorted(entry)}"
                )
            for name, t in live.items():
                s = entry[name]
                pairs = _same_kind(t, s)
                if pairs is None:
                    expected = (
                        f"{t.dtype} tensor of shape {tuple(t.shape)}"
                        if isinstance(t, torch.Tensor)
                        else _checks.describe(t)
                    )
                    if _dtensor.is_dtensor(t):
                        expected += (
                            f", {_dtensor.describe_sharding(t)} (a DTensor's shards: save "
                            "and load each rank's state_dict(), or use "
                            "torch.distributed.checkpoint)"
                        )
                    _checks.fail(
                        ValueError, fn, f"{where}[{name!r}]", expected, _checks.describe(s),
                        "A MasterOptimizer state is loaded as saved, never cast",
                    )  # fmt: skip
                for live_t, saved_t in pairs:
                    if saved_t is not live_t:
                        dst.append(live_t)
                        src.append(saved_t.to(live_t.device))
        if "state_dtype" in self._keys:
            for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
                if saved["state_dtype"] != group["state_dtype"]:
                    # Entries that passed are this dtype's too (None and torch.float32 both
                    # make fp32 moments; a group without entries has none), yet the next
                    # step would refuse the saved value: refused here, before any write.
                    raise ValueError(
                        f"{fn}: param_groups[{i}]: state_dtype: expected "
                        f"{group['state_dtype']} (the state this optimizer holds), got "
                        f"{saved['state_dtype']}. Build the MasterOptimizer with the saved "
                        "state_dtype, then load"
                    )
        for j, pair in made.items():
            self._adopt(j, pair)  # the tensors of dst become its state
        # Masters put in place through opt.state before the load are loaded over: the
        # loaded values show in the params as any write into a master does.
        self._shown.clear()
        _plan.copy_grouped_(dst, src)
        # Each loaded "fp32" master is a written one, whatever the version counters say:
        # torch_xla's foreach copy bumps none, and the next step took the params' old
        # values over the loaded masters on XLA only (found in review).
        loaded = {id(t) for t in dst}
        for j, m in enumerate(self._masters):
            if isinstance(m, torch.Tensor) and id(m) in loaded:
                self._master_versions[j] = -1  # never a counter's value
        with torch.no_grad():
            for p, rounded in rewrites:  # params of old "remainder" entries, nearest even
                p.detach().copy_(rounded.to(p.device))
        for group, saved in zip(self.param_groups, saved_groups):
            saved["params"] = group["params"]
            if "param_names" in group:
                saved["param_names"] = group["param_names"]
        self.param_groups = saved_groups
        self._opt = None
        for j in fresh:  # taken up by the next step: step count 0, zero moments, a new master
            self.state[self._params[j]] = {}
        for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            hook(self)

    def _torch_optim_format(
        self, fn: str, groups: list[dict[str, Any]], state: Mapping[Any, Any]
    ) -> bool:
        """Whether ``groups``/``state`` are a torch.optim ``state_dict`` (none of mpfunc's
        own group keys, no master in any entry): then each group takes this optimizer's
        values for those keys (in place), after checking that the moments can be taken as
        they are (fp32 state) and that the weight decay keeps its meaning."""
        own = [k for k in ("impl", "state_dtype") if k in self._keys]
        masters = {"master", *(f for m in self._masters if m is not None
                               for f in _master_entries(m))}  # fmt: skip
        if not own or any(k in g for g in groups for k in own):
            return False
        if any(isinstance(e, Mapping) and set(e) & masters for e in state.values()):
            return False
        for i, (group, saved) in enumerate(zip(self.param_groups, groups)):
            where = f"{fn}: param_groups[{i}]"
            sd = group.get("state_dtype")
            if sd not in (None, torch.float32):
                raise ValueError(
                    f"{where}: expected state_dtype=None to load a torch.optim state_dict (its "
                    f"moments are fp32, taken as they are), got {sd}. Load it into a "
                    f"MasterOptimizer with fp32 state"
                )
            decoupled = saved.get("decoupled_weight_decay")
            want = self._factory is adamw
            if decoupled is not None and self._factory in (adam, adamw) and bool(decoupled) != want:
                raise ValueError(
                    f"{where}: expected the state of a torch.optim.{'AdamW' if want else 'Adam'} "
                    f"(mpfunc.{'adamw' if want else 'adam'}), got one with decoupled_weight_decay="
                    f"{bool(decoupled)}: its weight_decay means another update. Use "
                    f"mpfunc.{'adamw' if decoupled else 'adam'}"
                )
            for k in own:
                saved[k] = group[k]
        return True

    def _check_values(self, where: str, i: int, values: Mapping[str, Any]) -> None:
        """Group ``i``'s values as loaded meet the rules the constructor applies: every
        hyperparameter of the factory present, accepted by it, and using the state fields
        this optimizer holds for the group (turning ``amsgrad`` on needs a state it does
        not have). Builds nothing that stays."""
        missing = [k for k in self._keys if k not in values]
        if missing:
            raise ValueError(
                f"{where}: expected the hyperparameters {', '.join(self._keys)} (those of "
                f"{getattr(self._factory, '__name__', 'the factory')}), got no "
                f"{', '.join(missing)}"
            )
        kw = {k: values[k] for k in self._keys}
        params = self.param_groups[i]["params"]
        try:
            if (
                params
                and _plan.is_lazy(params[0].device)
                and not isinstance(kw["lr"], torch.Tensor)
            ):
                _checks.real("MasterOptimizer", "lr", kw["lr"], ge=0.0)  # as _build reads it
            fresh = self._factory(**kw).init([None])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from e
        held = self._states.get(str(i))
        if held is None or type(fresh) is not type(held):  # pragma: no cover - one factory
            return
        used = [n for n in fresh._fields if getattr(fresh, n) is not None]
        has = [n for n in held._fields if getattr(held, n) is not None]
        if sorted(used) != sorted(has):
            raise ValueError(
                f"{where}: expected values whose state this optimizer holds "
                f"({', '.join(sorted(has))}), got values that use {', '.join(sorted(used))}. "
                "Build the MasterOptimizer with the saved values, then load"
            )

    def _built_for_load(self, fn: str) -> None:
        try:
            self._optimizer()
        except (TypeError, ValueError) as e:  # pragma: no cover - values checked at add
            raise type(e)(f"{fn}: {e}") from e
