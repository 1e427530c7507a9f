"""``bench.common.memory`` against hand counts on tiny models.

The peak leaves activations apart; what it counts is known exactly for torch.optim's
algorithms: params, optimizer state, grads, and the optimizer's own temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from bench.common.memory import StepMemory, measure_step, persistent_bytes

SLACK = 4096  # bytes: 0-d step counters, scalar temporaries, the loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


def _batch() -> torch.Tensor:
    # Activations (batch 512 x 128 hidden, several copies) outweigh the 12k params.
    return torch.randn(512, 64)


def _measure(
    model: nn.Module, opt: torch.optim.Optimizer, extra: list[torch.Tensor] | None = None
) -> tuple[StepMemory, int]:
    x = _batch()

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # lazy optimizer state
    held = [list(model.parameters()), list(opt.state.values()), extra or []]
    return measure_step(step, held), sum(p.numel() for p in model.parameters())


def test_sgd_momentum_is_params_state_and_grads() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    untouched = torch.zeros(1000)  # held, never read by the step: counted from the tensor
    mem, n = _measure(model, opt, [untouched, untouched[10:]])
    assert mem.persistent == 4 * n + 4 * n + 4000
    assert abs(mem.peak - (mem.persistent + 4 * n)) <= SLACK
    # The activations were there, and left apart.
    assert mem.activations > 4 * n
    assert mem.total >= mem.peak + mem.activations // 2


@pytest.mark.parametrize(
    ("kwargs", "temporaries"),
    [
        ({"fused": True}, 0),  # one kernel, in place
        ({"foreach": True}, 4),  # _foreach_sqrt of every exp_avg_sq at once
    ],
)
def test_adamw_counts_its_temporaries(kwargs: dict[str, Any], temporaries: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    mem, n = _measure(model, opt)
    assert abs(mem.persistent - 12 * n) <= SLACK  # param 4 + exp_avg 4 + exp_avg_sq 4
    assert abs(mem.peak - (mem.persistent + 4 * n + temporaries * n)) <= SLACK


def test_grads_released_in_backward_peak_at_one_layer() -> None:
    """A step inside backward: each grad applied and freed by a post-accumulate hook, so
    the peak holds one layer's grads and the update's temporary, not the tree."""
    model = _model()
    ps = list(model.parameters())

    def sgd(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.data.add_(p.grad * -1e-2)  # a temporary the size of the grad
        p.grad = None

    for p in ps:
        p.register_post_accumulate_grad_hook(sgd)  # type: ignore[no-untyped-call]
    x = _batch()

    def step() -> None:
        model(x).square().mean().backward()

    step()
    mem = measure_step(step, [ps])
    n = sum(p.numel() for p in ps)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    largest = max(m.weight.numel() for m in layers)
    largest_layer = max(m.weight.numel() + m.bias.numel() for m in layers)
    assert mem.persistent == 4 * n
    assert mem.persistent + 8 * largest <= mem.peak <= mem.persistent + 8 * largest_layer + SLACK


def test_grads_alive_at_the_start_are_counted_and_given_back() -> None:
    """Grads left from the previous step, released when the next starts (``p.grad = None``
    before the forward, as ``bench.convergence`` does), count as held at the start."""
    model = _model()
    ps = list(model.parameters())
    opt = torch.optim.SGD(ps, lr=1e-2, foreach=False)
    x = _batch()

    def step() -> None:
        for p in ps:
            p.grad = None
        model(x).square().mean().backward()
        opt.step()

    step()
    n = sum(p.numel() for p in ps)
    mem = measure_step(step, [ps])
    assert mem.persistent == 4 * n
    assert abs(mem.peak - 8 * n) <= SLACK


class _Pair(NamedTuple):
    a: torch.Tensor
    b: Any


def test_persistent_bytes_counts_each_storage_once() -> None:
    base = torch.zeros(100)
    tree: dict[str, Any] = {"x": base, "view": base[10:20], "t": _Pair(base.view(10, 10), [None])}
    assert persistent_bytes(tree, [base]) == 400
    assert persistent_bytes({"a": torch.zeros(3, dtype=torch.bfloat16)}, 5, None) == 6


def test_tensor_subclasses_are_opened() -> None:
    class Pair(torch.Tensor):
        @staticmethod
        def __new__(cls, a: torch.Tensor, b: torch.Tensor) -> Pair:
            return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype)

        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self.a, self.b = a, b

        def __tensor_flatten__(self) -> tuple[list[str], None]:
            return ["a", "b"], None

        @classmethod
        def __torch_dispatch__(  # type: ignore[override]
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise NotImplementedError

    make: Callable[..., Pair] = Pair
    t = make(torch.zeros(8, dtype=torch.uint8), torch.zeros(2))
    assert persistent_bytes([t]) == 8 + 8


def test_state_objects_count_the_tensors_they_hold_as_attributes() -> None:
    # FlashOptim keeps each moment in an object (_MaybeQuantizedTensor) whose tensors are
    # attributes: counted, once per storage; a module or a class among the values is not
    # walked (its tensors are not the state's).
    from bench.common import memory

    class Held:
        def __init__(self, t: torch.Tensor) -> None:
            self._data = t
            self._scales = None
            self.signed = True

    a = torch.zeros(100, dtype=torch.bfloat16)
    state = {"exp_avg": Held(a), "exp_avg_sq": Held(torch.zeros(100)), "alias": Held(a)}
    assert memory.persistent_bytes(state) == 200 + 400
    assert memory.persistent_bytes({"m": torch.nn.Linear(3, 3), "k": Held}) == 0
