"""FSDP2 (``fully_shard``) and DTensor leaves, on a real gloo group of 2 processes.

One launch (tests/workers/fsdp2_worker.py) checks every transform on DTensor shards
against the same transform on the full tensors, in each rank, then trains
``examples/fsdp2_train.py``'s loop: a bf16 model under ``fully_shard`` with mpfunc's fp32
masters and AdamW state for the local shards only. The bound against single-process
training (the same mpfunc loop, each step's grad the mean of the ranks' micro-batch
grads, as FSDP2 reduces them): max|a - b| <= 1e-5 * max|b| (torch's fused AdamW may
round an element differently where a shard boundary moves it between the vectorized
body and the scalar tail; observed: bit-identical but for one 5-element bias, 7e-9).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from support.examples import load
from support.ranks import check_ok, launch

import mpfunc

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "fsdp2_worker.py"
BOUND = 1e-5


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


# torch < 2.6 keeps fully_shard private (torch.distributed._composable.fsdp); CI runs 2.9.
pytestmark = pytest.mark.skipif(not _has_fully_shard(), reason="torch < 2.6: no public fully_shard")


@pytest.mark.slow
def test_fsdp2_with_masters_for_local_shards(tmp_path: pathlib.Path) -> None:
    check_ok(launch("all", 2, tmp_path, timeout=240, worker=WORKER))
    ranks = [torch.load(tmp_path / f"fsdp2-rank{r}.pt", weights_only=False) for r in range(2)]
    ref = load("fsdp2_train").reference(ranks[0]["steps"], 2)
    for name, m in ref["masters"].items():
        for res in ranks:  # the gathered masters and params, on each rank
            got = res["masters"][name]
            assert float((got - m).abs().max()) <= BOUND * float(m.abs().max()), name
            # The model is its masters rounded, bit for bit; the ranks agree.
            assert torch.equal(res["params"][name], got.to(torch.bfloat16)), name
            assert torch.equal(res["params"][name], ranks[0]["params"][name]), name
        # Each rank's masters are its shard: the rows split between the ranks.
        rows = [res["local_shapes"][name][0] if res["local_shapes"][name] else 1 for res in ranks]
        assert sum(rows) == m.shape[0] and max(rows) == -(-m.shape[0] // 2), (name, rows)
    # Masters and AdamW state per rank: half of the full model's, plus the 0-d step counts.
    full = sum(3 * m.nbytes + 4 for m in ref["masters"].values())
    for res in ranks:
        assert res["local_bytes"] <= full / 2 + 4 * 64 * 4, (res["local_bytes"], full)
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp2_remainder_ties_are_the_fp32_run(tmp_path: pathlib.Path) -> None:
    """Remainder masters under FSDP2: the tie bits are placed as their params (a shard
    that would split a tie byte is refused, naming the leaf); Lion on updates that land on
    exact ties gives the "fp32" run's params, masters and state bit for bit at every step
    (asserted in the ranks), through the functional API and through ``MasterOptimizer``
    (whose per-rank ``state_dict()`` resumes bit for bit); a DCP checkpoint of the sharded
    run resumes bit for bit at 2 ranks and loads here, in one process, to the fp32 run's
    masters."""
    import torch.distributed.checkpoint as dcp

    from mpfunc.strategies import _remainder

    check_ok(launch("ties", 2, tmp_path, timeout=240, worker=WORKER))
    ranks = [torch.load(tmp_path / f"ties-rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        assert res["ties"] > 0 and res["set_bits"] > 0, res["ties"]
    # The checkpoint's tie tensors are the whole params' packing: loaded unsharded (DCP
    # reshards 2 -> 1), joined, they are the fp32 run's masters at the checkpoint.
    spec = importlib.util.spec_from_file_location("fsdp2_worker", WORKER)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    params = dict(worker.tie_model().named_parameters())
    kinds = ranks[0]["kinds"]
    strategy = {n: "remainder" if kinds[n] == "RemainderMaster" else "fp32" for n in params}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = mpfunc.lion(lr=worker.TIE_LR, weight_decay=0.0)
    tree = {"masters": masters, "opt": opt.init(masters), "params": params}
    dcp.load(mpfunc.state_dict(tree), checkpoint_id=str(tmp_path / "ties-dcp"))
    for n, want in ranks[0]["saved_fp32"].items():
        u = masters[n]
        got = _remainder.join(*u) if isinstance(u, tuple) else u
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), n


@pytest.mark.slow
def test_stochastic_shards_encoded_state_and_whole_loads(
    tmp_path: pathlib.Path,
) -> None:
    """ "stochastic" masters on DTensor shards: every rank drew the same bits for its local
    element ``i``, so the shards' rounding was correlated (equal rows on two ranks stayed
    equal). Asserted in the ranks, as are the refusals, before any write, of 8- and 4-bit
    moments for DTensor masters (at init) and of a whole checkpoint loaded into DTensor
    state (``load_``, ``MasterOptimizer.load_state_dict``); the ranks' keys agree."""
    check_ok(launch("stochastic", 2, tmp_path, timeout=120, worker=WORKER))
    ranks = [torch.load(tmp_path / f"stochastic-rank{r}.pt") for r in range(2)]
    assert ranks[0]["keys"] == ranks[1]["keys"]
