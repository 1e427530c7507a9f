"""mpfunc: functional fp32 master weights for mixed-precision training.

Four transforms over parameter trees, each pure with an in-place twin::

    masters = mpfunc.init_master(params)                        # fp32 copies
    g32 = mpfunc.grads_to_fp32(grads)                           # bf16 grads -> fp32
    masters, state = mpfunc.apply_update(masters, g32, state, opt)
    params = mpfunc.masters_to_model(masters, params)           # round back

or the whole mixed step in one pass, low-precision grads in and params out::

    mpfunc.apply_update_(masters, grads, state, opt, params=params)

Masters may be kept by a strategy (``init_master(params, strategy="remainder")``: fp32,
remainder, kahan, stochastic, none) and moments in ``state_dtype`` fp32, bf16 or 8-bit;
``MasterOptimizer`` wraps it all as a ``torch.optim.Optimizer``. And the pieces a
training loop needs around them: sync-free loss scaling and
step skipping, global-norm clipping, fp32 accumulation, a precision policy,
per-leaf hyperparameters, checkpoints and data parallelism. Import only from
``mpfunc``; the ``_``-prefixed modules are private.
"""

import importlib.metadata as _metadata

from mpfunc.backends._diagnostics import UpdateStats, init_stats
from mpfunc.backends._xla_watch import HostReadWarning, PendingGraphWarning
from mpfunc.checkpoint._file import load, load_, save
from mpfunc.checkpoint._state_dict import (
    load_state_dict,
    load_state_dict_,
    masters_from_remainders,
    masters_state_dict,
    remainders_state_dict,
    state_dict,
)
from mpfunc.core._consumed_grad import ConsumedGrad
from mpfunc.core._optimizer import Optimizer
from mpfunc.optim._adam import AdamState, adam, adamw
from mpfunc.optim._lion import LionState, lion
from mpfunc.optim._master_optimizer import MasterOptimizer, NoGradWarning
from mpfunc.optim._migrate import from_torch_optim, frozen
from mpfunc.optim._sgd import SGDState, sgd
from mpfunc.optim._torch_optim import TorchOptimizerState, torch_optimizer
from mpfunc.parallel._all_reduce import all_reduce_grads, all_reduce_grads_
from mpfunc.parallel._replicas import verify_replicas
from mpfunc.parallel._sharded import broadcast_params_, reduce_grads_to_owners, shard, shard_plan
from mpfunc.parallel._sharding import mark_sharding_
from mpfunc.state_formats._quantize import QState
from mpfunc.state_formats._quantize4 import Q4State
from mpfunc.strategies._strategy_kahan import KahanMaster
from mpfunc.strategies._strategy_none import RoundedMaster
from mpfunc.strategies._strategy_remainder import RemainderMaster
from mpfunc.strategies._strategy_stochastic import StochasticMaster
from mpfunc.transforms._accumulate import accumulate_grads, accumulate_grads_, init_grads
from mpfunc.transforms._apply_update import apply_update, apply_update_
from mpfunc.transforms._clip import clip_by_global_norm, clip_by_global_norm_
from mpfunc.transforms._finite import all_finite
from mpfunc.transforms._grads_to_fp32 import grads_to_fp32, grads_to_fp32_
from mpfunc.transforms._init_master import init_master
from mpfunc.transforms._loss_scale import DynamicLossScale, StaticLossScale
from mpfunc.transforms._masters_to_model import masters_to_model, masters_to_model_
from mpfunc.transforms._partition import partition
from mpfunc.transforms._policy import Policy
from mpfunc.transforms._step_in_backward import StepInBackward, step_in_backward

try:
    __version__ = _metadata.version("mpfunc")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"

__all__ = [
    "AdamState",
    "ConsumedGrad",
    "DynamicLossScale",
    "HostReadWarning",
    "KahanMaster",
    "LionState",
    "MasterOptimizer",
    "NoGradWarning",
    "Optimizer",
    "PendingGraphWarning",
    "Policy",
    "Q4State",
    "QState",
    "RemainderMaster",
    "RoundedMaster",
    "SGDState",
    "StaticLossScale",
    "StepInBackward",
    "StochasticMaster",
    "TorchOptimizerState",
    "UpdateStats",
    "accumulate_grads",
    "accumulate_grads_",
    "adam",
    "adamw",
    "all_finite",
    "all_reduce_grads",
    "all_reduce_grads_",
    "apply_update",
    "apply_update_",
    "broadcast_params_",
    "clip_by_global_norm",
    "clip_by_global_norm_",
    "from_torch_optim",
    "frozen",
    "grads_to_fp32",
    "grads_to_fp32_",
    "init_grads",
    "init_master",
    "init_stats",
    "lion",
    "load",
    "load_",
    "load_state_dict",
    "load_state_dict_",
    "mark_sharding_",
    "masters_from_remainders",
    "masters_state_dict",
    "masters_to_model",
    "masters_to_model_",
    "partition",
    "reduce_grads_to_owners",
    "remainders_state_dict",
    "save",
    "sgd",
    "shard",
    "shard_plan",
    "state_dict",
    "step_in_backward",
    "torch_optimizer",
    "verify_replicas",
]
