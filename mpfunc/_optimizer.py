"""What an mpfunc optimizer is.

An optimizer is a pair of functions, in the spirit of optax: ``init`` builds a
state tree from the masters, and ``plan`` checks a state against one step's
inputs and returns the kernel calls that will write the step, without writing
anything. ``apply_update``/``apply_update_`` run the pipeline
check -> plan -> run (see ``_apply_update``).

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
from typing import Any, NamedTuple, Union

import torch
from optree import PyTreeSpec

from mpfunc._checks import LR, Side

__all__ = ["Group", "Kernel", "Optimizer", "Rule", "Step", "TensorList", "Work", "unless_skipped"]

# What torch's foreach ops take and return.
TensorList = Union[list[torch.Tensor], tuple[torch.Tensor, ...]]


class Step(NamedTuple):
    """A step's checked inputs: masters and grads flattened once, and ``skip``."""

    masters: Side
    spec: PyTreeSpec
    grads: Side
    skip: torch.Tensor | None  # 0-d bool: when true, the step changes nothing
    state_name: str = "state"  # how errors name the state: "state['decay']" in a partition

    def only(self, keep: list[bool], state_name: str) -> Step:
        """The same step over the leaves where ``keep`` is true (others become ``None``):
        what one sub-optimizer of a ``partition`` sees, its state named ``state_name``."""
        m, g = self.masters, self.grads
        return self._replace(
            state_name=state_name,
            masters=m._replace(leaves=[x if k else None for x, k in zip(m.leaves, keep)]),
            grads=g._replace(leaves=[x if k else None for x, k in zip(g.leaves, keep)]),
        )


class Group(NamedTuple):
    """The leaves of one kernel call: one device, one dtype, lists aligned by position.

    ``params`` are the masters, written in place. ``state`` is the optimizer's own state
    NamedTuple (``AdamState``, ...) whose used fields hold the matching lists of state
    tensors, also written in place, and whose unused fields are ``None``. ``lr`` is a
    float or a 0-d tensor on the group's device. When ``skip`` (0-d bool, on the device)
    is true, the kernel must leave every tensor it writes bit-identical.

    ``model`` (optional): the low-precision model params, one per master, that receive the
    masters after the step rounded to their dtype (round to nearest even, as ``Tensor.to``);
    written even when skipped. ``scale`` (optional): a 0-d fp32 divisor on the device; the
    grads, which may then arrive in low precision, are widened and divided by it first.
    Only a kernel the plan picks for such a group receives them (``"xla"``, ``"native"``).
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: Any
    lr: LR
    skip: torch.Tensor | None
    model: list[torch.Tensor] | None = None
    scale: torch.Tensor | None = None


# Every kernel has this signature: (group, hyperparameters) -> None, writing in place.
Kernel = Callable[[Group, Any], None]


class Work(NamedTuple):
    """One kernel call of a step."""

    kernel: Kernel
    group: Group
    hyper: Any


class Rule(NamedTuple):
    """An elementwise optimizer: everything ``elementwise`` needs to check and step it.

    ``fields(hyper)`` maps each state field the hyperparameters use to its kind:
    ``"step"`` (a 0-d float32 count per leaf) or ``"moment"`` (like the master); the
    other fields of ``state_type`` must be ``None``. ``kernels`` maps an implementation
    name (``"reference"``, ``"foreach"``, ``"fused"``, ``"xla"``) to its kernel.
    """

    name: str
    state_type: type
    fields: Callable[[Any], Mapping[str, str]]
    kernels: Mapping[str, Kernel]


class Optimizer(NamedTuple):
    """An optimizer over master trees: ``init(masters) -> state`` and ``plan``.

    ``plan(step, state, fn)`` checks ``state`` against the step (errors name ``fn``, the
    caller) and returns the kernel calls, writing nothing. Leaves whose grad is ``None``
    are skipped, as torch.optim skips parameters without ``.grad``. Build one with
    ``mpfunc.sgd``, ``adam``, ``adamw``, ``lion``, ``partition`` or ``torch_optimizer``;
    call it through ``apply_update``/``apply_update_``.
    """

    init: Callable[[Any], Any]
    plan: Callable[[Step, Any, str], list[Work]]
    # False when the state is not a tree of tensors (torch.optim interop): such an
    # optimizer cannot be copied, so only apply_update_ accepts it.
    functional: bool = True
    name: str = "optimizer"


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
