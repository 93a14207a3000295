"""Chapter 01, held out: bucketed DDP on a model the student has not seen — three branches of unequal
size, each rank running them in its own order (a permutation drawn from the rank), so every rank
completes its buckets in another order, and buckets of unequal size. Checked, as the visible tests, in
float64 against one process on the global batch, over two backwards, within ``model_bound`` of the
reductions' length and depth (tests/_support.py).
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _support import close, float64, model_bound

pytestmark = pytest.mark.ch01
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

IN, OUT, ROWS, ELEM = 5, 4, 3, 8
WIDTHS = (2, 3, 4)  # branch k: Linear(IN, w) then Linear(w, OUT); one bucket per branch
# the longest reduction: the global batch's rows; chained: two linears and the combination forward, the
# same back, the weight gradient's sum over rows, the all-reduce
N, DEPTH = 4 * ROWS, 8


class _ThreeBranches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(IN, w), nn.Tanh(), nn.Linear(w, OUT))
                                      for w in WIDTHS)

    def forward(self, x, order=(0, 1, 2)):
        ys = {k: self.branches[k](x) for k in order}  # autograd runs the branch created last first
        return ys[0] * torch.tanh(ys[1]) + ys[2]


def _branch_bytes(w):
    return (IN * w + w + w * OUT + OUT) * ELEM


def _batch(rows):
    g = torch.Generator().manual_seed(11)
    return torch.randn(rows, IN, generator=g, dtype=torch.float64), \
        torch.randn(rows, OUT, generator=g, dtype=torch.float64)


def _on_ranks(install):
    with float64():
        r, n = dist.get_rank(), dist.get_world_size()
        x, y = _batch(n * ROWS)
        x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        model = _ThreeBranches()
        install(model, max(_branch_bytes(w) for w in WIDTHS), None)
        order = torch.randperm(3, generator=torch.Generator().manual_seed(100 + r)).tolist()
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x, order), y).backward()
            grads.append([q.grad.clone() for q in model.parameters()])
        return {"grads": grads, "order": order}


@pytest.fixture(scope="module")
def runs(ex, launches):
    return launches(_on_ranks, ex.install_bucketed_gradient_hooks, timeout_s=60)


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_three_branches_in_rank_orders(runs, n):
    with float64():
        model = _ThreeBranches()
        x, y = _batch(n * ROWS)
        F.mse_loss(model(x), y).backward()
        ref = [q.grad for q in model.parameters()]
    res = runs(n)
    assert len({tuple(r["order"]) for r in res}) > 1, "the premise: ranks run the branches in other orders"
    bound = model_bound(n=N, depth=DEPTH, scale=max(1.0, max(g.abs().max().item() for g in ref)))
    for r, got in enumerate(res):
        for k, grads in enumerate(got["grads"]):
            for i, (g, want) in enumerate(zip(grads, ref)):
                close(g, want, bound, f"rank {r} of {n} (branch order {got['order']}), backward {k}, "
                                      f"parameter {i}")
