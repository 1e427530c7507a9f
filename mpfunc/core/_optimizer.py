"""What an mpfunc optimizer is.

An optimizer is a pair of functions, in the spirit of optax: ``init`` builds a
state tree from the masters, and ``plan`` checks a state against one step's
inputs and returns the kernel calls that will write the step, without writing
anything. ``apply_update``/``apply_update_`` run the pipeline
check -> plan -> memory check -> run (see ``_apply_update``).

Most optimizers are elementwise: they are a ``Rule`` (a state NamedTuple, the
fields a given set of hyperparameters uses, and one kernel per implementation),
and ``elementwise`` turns a rule into an ``Optimizer``. Adding one means writing
a module like ``_lion.py``: state, hyperparameters, kernels, a factory.

The protocol is closed: users build optimizers with the factories (``sgd``,
``adam``, ``adamw``, ``lion``, ``partition``, ``torch_optimizer``), never by hand.
A kernel's contract (in place, sync-free, honouring ``skip`` bit for bit,
bounded temporaries, layouts) is subtle and will grow with master strategies and
state dtypes; any torch.optim class runs through ``torch_optimizer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn, Union

import torch
from optree import PyTreeSpec

from mpfunc.core._checks import LR, Side, Sweep

__all__ = [
    "Group",
    "Kernel",
    "Optimizer",
    "Rule",
    "Step",
    "TensorList",
    "Work",
    "unless_skipped",
]

# What torch's foreach ops take and return.
TensorList = Union[list[torch.Tensor], tuple[torch.Tensor, ...]]


class Step(NamedTuple):
    """A step's checked inputs, flattened once.

    ``masters``: the master leaves (tensors for ``"fp32"``, units for the other
    strategies); ``faces``: per leaf, the tensor that gives its shape and device (the
    master, or the unit's param); ``kinds``: per leaf, its ``Strategy`` (``None`` where the
    leaf has no master). ``grads``: fp32/fp64, or narrower floats upcast inside the step.
    ``model``: the params that receive the rounded ``"fp32"`` masters (``params=``), or
    ``None``. ``scale``: the 0-d fp32 loss scale the grads are divided by, or ``None``.
    ``stats``: a ``Diagnostics`` tree's leaves to fill, or ``None``.
    """

    masters: Side
    spec: PyTreeSpec
    grads: Side
    skip: torch.Tensor | None  # 0-d bool: when true, the step changes nothing
    state_name: str = "state"  # how errors name the state: "state['decay']" in a partition
    faces: list[Any] | None = None
    kinds: list[Any] | None = None
    model: Side | None = None
    scale: torch.Tensor | None = None
    stats: list[Any] | None = None
    # The memo entry of these checked inputs (``_cache.MemoEntry``), where the plan may
    # remember its per-leaf decisions (through ``sweep.keep``); ``None``: plan in full.
    memo: Any = None
    # The step's one memory check (``Sweep``), to which each plan adds its state: ``None``
    # only for steps that write nothing but fresh copies (the pure ``apply_update``).
    sweep: Sweep | None = None

    def only(self, keep: list[bool], state_name: str) -> Step:
        """The same step over the leaves where ``keep`` is true (others become ``None``):
        what one sub-optimizer of a ``partition`` sees, its state named ``state_name``."""

        def cut(xs: list[Any]) -> list[Any]:
            return [x if k else None for x, k in zip(xs, keep)]

        def maybe(xs: list[Any] | None) -> list[Any] | None:
            return None if xs is None else cut(xs)

        m, g, p = self.masters, self.grads, self.model
        return self._replace(
            state_name=state_name,
            masters=m._replace(leaves=cut(m.leaves)),
            grads=g._replace(leaves=cut(g.leaves)),
            faces=maybe(self.faces),
            kinds=maybe(self.kinds),
            model=None if p is None else p._replace(leaves=cut(p.leaves)),
            stats=maybe(self.stats),
            # A sub-plan remembers its decisions under this cut of the leaves.
            memo=None if self.memo is None else self.memo.child((state_name, tuple(keep))),
            # (sweep: the same object, so every sub-plan's state joins the one check.)
        )


class Group(NamedTuple):
    """The leaves of one kernel call: one device, one dtype, lists aligned by position.

    ``params`` are the masters, written in place. ``state`` is the optimizer's own state
    NamedTuple (``AdamState``, ...) whose used fields hold the matching lists of state
    tensors, also written in place, and whose unused fields are ``None``. ``lr`` is a
    float or a 0-d tensor on the group's device. When ``skip`` (0-d bool, on the device)
    is true, the kernel must leave every tensor it writes bit-identical.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: Any
    lr: LR
    skip: torch.Tensor | None
    # Only for kernels that take a step whole ("native", "xla"): the low-precision params
    # to write (rounded to nearest even, as Tensor.to), and the 0-d fp32 loss scale the
    # grads (then possibly bf16/fp16) are divided by. The other kernels get fp32 grads
    # and write masters only; _plan does the rest around them.
    model: list[torch.Tensor] | None = None
    scale: torch.Tensor | None = None
    # Each leaf's place in the whole tree (the salt of its 8-bit state's draws), for the
    # kernels that store the state themselves ("native").
    salts: list[int] | None = None


# Every kernel has this signature: (group, hyperparameters) -> None, writing in place.
Kernel = Callable[[Group, Any], None]


class Work(NamedTuple):
    """One kernel call of a step (``group`` is a ``Group``, or what ``kernel`` takes)."""

    kernel: Callable[[Any, Any], None]
    group: Any
    hyper: Any


class Rule(NamedTuple):
    """An elementwise optimizer: everything ``elementwise`` needs to check and step it.

    ``fields(hyper)`` maps each state field the hyperparameters use to its kind:
    ``"step"`` (a 0-d float32 count per leaf), ``"moment"`` (like the master, any sign) or
    ``"square"`` (like the master, never negative: 8-bit states use an unsigned code);
    the other fields of ``state_type`` must be ``None``. ``kernels`` maps an implementation
    name (``"reference"``, ``"foreach"``, ``"fused"``, ``"xla"``) to its kernel.
    """

    name: str
    state_type: type
    fields: Callable[[Any], Mapping[str, str]]
    kernels: Mapping[str, Kernel]


class Optimizer(NamedTuple):
    """An optimizer over master trees: ``init(masters) -> state`` and ``plan``.

    ``plan(step, state, fn)`` checks ``state`` against the step (errors name ``fn``, the
    caller), adds the state tensors it will write to ``step.sweep`` (the step's one
    memory check, run after every plan) and returns the kernel calls, writing nothing.
    Leaves whose grad is ``None`` are skipped, as torch.optim skips parameters without
    ``.grad``. Build one with ``mpfunc.sgd``, ``adam``, ``adamw``, ``lion``, ``partition``
    or ``torch_optimizer``; call it through ``apply_update``/``apply_update_``.

    It is not a ``torch.optim.Optimizer``: ``opt.step()``, ``opt.param_groups`` and the
    other torch.optim attributes raise an ``AttributeError`` that points to
    ``mpfunc.MasterOptimizer`` (the torch.optim-style wrapper) and ``apply_update_``.
    """

    init: Callable[[Any], Any]
    plan: Callable[[Step, Any, str], list[Work]]
    # False when the state is not a tree of tensors (torch.optim interop): such an
    # optimizer cannot be copied, so only apply_update_ accepts it.
    functional: bool = True
    name: str = "optimizer"


# What torch.optim.Optimizer users reach for; on a functional optimizer each gets a pointer
# to MasterOptimizer. (torch's lr schedulers check isinstance(opt, torch.optim.Optimizer)
# first and say "Optimizer is not an Optimizer"; LambdaLR and others read param_groups.)
_TORCH_OPTIM_ATTRS = frozenset(
    {
        "step",
        "zero_grad",
        "param_groups",
        "state_dict",
        "load_state_dict",
        "add_param_group",
        "defaults",
        "state",
    }
)
# The names of the optimizers ``_plan.elementwise`` has made, each a public factory
# (``mpfunc.<name>``, as ``Rule.name`` says): the torch.optim-habit errors name it.
_FACTORIES: set[str] = set()


def made_by_factory(name: str) -> None:
    """Records that ``name`` is a factory's name (``mpfunc.<name>``)."""
    _FACTORIES.add(name)


def _not_torch_optim(opt: Optimizer, attr: str) -> str:
    """The ``AttributeError`` message for ``opt.<attr>``."""
    plain = f"'Optimizer' object has no attribute {attr!r}"
    if attr not in _TORCH_OPTIM_ATTRS:
        return plain
    factory = f"mpfunc.{opt.name}" if opt.name in _FACTORIES else "mpfunc.adamw"
    made = f"{factory}(...)" if opt.name in _FACTORIES else f"this optimizer ({opt.name!r})"
    return (
        f"{plain}: {made} is a functional mpfunc optimizer (init and plan, as in optax), "
        f"not a torch.optim.Optimizer. For step(), zero_grad(), param_groups and lr "
        f"schedulers, use mpfunc.MasterOptimizer(model.parameters(), opt={factory}, lr=...); "
        f"to step this one, call mpfunc.apply_update_(masters, grads, state, opt) with "
        f"state = opt.init(masters)"
    )


def _optimizer_getattr(self: Optimizer, attr: str) -> NoReturn:
    # Only reached for a name that is not a field or method: a torch.optim habit gets
    # directions, anything else (copy's __deepcopy__ probe, hasattr) the usual error.
    raise AttributeError(_not_torch_optim(self, attr), name=attr, obj=self)


# Set from outside the class body: typing.NamedTuple's body takes fields and methods alike,
# but mypy would then accept any attribute of an Optimizer (a typo would pass type checks).
setattr(Optimizer, "__getattr__", _optimizer_getattr)  # noqa: B010


@contextlib.contextmanager
def unless_skipped(skip: torch.Tensor | None, written: Sequence[torch.Tensor]) -> Iterator[None]:
    """Lets a kernel write ``written`` in place, then, where ``skip`` is true on the device,
    puts every old bit back. No host read: the old values are kept and chosen back with
    ``torch.where``. The copies are bounded by the foreach chunk size on eager devices;
    on XLA the select fuses into the step's graph."""
    if skip is None:
        yield
        return
    old = [t.clone() for t in written]
    yield
    for t, o in zip(written, old):
        t.copy_(torch.where(skip, o, t))
