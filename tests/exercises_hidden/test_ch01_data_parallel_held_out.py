"""Chapter 01, held out: bucketed DDP on a model the student has not seen — three branches of unequal
size, each rank running them in its own order (a permutation drawn from the rank), so every rank
completes its buckets in another order, and buckets of unequal size. Checked, as the visible tests, in
float64 against one process on the global batch, over two backwards, within ``model_bound`` of the
reductions' length and depth (tests/_support.py). Then a shared layer run twice and a weight tied
between two layers, registered out of use order, over three backwards (the first, the rebuild, one
more): depth 13 (five layers forward and back, the row sum, the three uses' sum, the all-reduce).
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


# A shared layer run twice and a weight tied between two layers: model.parameters() lists each once, and
# autograd sums a parameter's uses before its one post-accumulate hook. Registered out of use order, so
# the rebuilt buckets differ from the first ones. Three backwards: the first, the rebuild, one more.
class _SharedAndTied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.head = nn.Linear(6, OUT)
        self.shared = nn.Linear(6, 6)
        self.enc, self.dec = nn.Linear(IN, 6), nn.Linear(6, 6, bias=False)
        self.dec.weight = self.shared.weight  # tied

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.enc(x))))
        return self.head(torch.tanh(self.shared(h)) + self.dec(h))


def _shared_on_ranks(install):
    with float64():
        r, n = dist.get_rank(), dist.get_world_size()
        x, y = _batch(n * ROWS)
        x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        model = _SharedAndTied()
        install(model, 40 * ELEM, 8 * ELEM)
        grads = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            grads.append([q.grad.clone() for q in model.parameters()])
        return grads


@pytest.fixture(scope="module")
def shared_runs(ex, launches):
    return launches(_shared_on_ranks, ex.install_bucketed_gradient_hooks, timeout_s=60)


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_shared_and_tied_parameters(shared_runs, n):
    with float64():
        model = _SharedAndTied()
        x, y = _batch(n * ROWS)
        F.mse_loss(model(x), y).backward()
        ref = [q.grad for q in model.parameters()]
    # the longest reduction: the global batch's rows; chained: five layers forward, five back, the
    # weight gradient's sum over rows and the shared weight's sum of three uses, the all-reduce
    bound = model_bound(n=N, depth=13, scale=max(1.0, max(g.abs().max().item() for g in ref)))
    for r, grads_by_backward in enumerate(shared_runs(n)):
        for k, grads in enumerate(grads_by_backward):
            assert len(grads) == len(ref), "one gradient per distinct parameter"
            for i, (g, want) in enumerate(zip(grads, ref)):
                close(g, want, bound, f"rank {r} of {n}, backward {k}, parameter {i} (shared or tied)")
