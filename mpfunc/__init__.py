"""mpfunc: functional fp32 master weights for mixed-precision training.

Four transforms over parameter trees, each pure with an in-place twin::

    masters = mpfunc.init_master(params)                        # fp32 copies
    g32 = mpfunc.grads_to_fp32(grads)                           # bf16 grads -> fp32
    masters, state = mpfunc.apply_update(masters, g32, state, opt)
    params = mpfunc.masters_to_model(masters, params)           # round back

Import only from ``mpfunc``; the ``_``-prefixed modules are private.
"""

from mpfunc._adam import AdamState, adam, adamw
from mpfunc._apply_update import apply_update, apply_update_
from mpfunc._grads_to_fp32 import grads_to_fp32, grads_to_fp32_
from mpfunc._init_master import init_master
from mpfunc._masters_to_model import masters_to_model, masters_to_model_
from mpfunc._optimizer import Optimizer
from mpfunc._sgd import SGDState, sgd
from mpfunc._torch_optim import TorchOptimizerState, torch_optimizer

__version__ = "0.1.0"

__all__ = [
    "AdamState",
    "Optimizer",
    "SGDState",
    "TorchOptimizerState",
    "adam",
    "adamw",
    "apply_update",
    "apply_update_",
    "grads_to_fp32",
    "grads_to_fp32_",
    "init_master",
    "masters_to_model",
    "masters_to_model_",
    "sgd",
    "torch_optimizer",
]
