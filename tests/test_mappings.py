"""Chapter 04: every region-crossing operator of ``parallelism.mappings``, forward and backward, on
t = 2 and 4 gloo ranks against its definition written out here on all ranks' tensors, with the one
collective each direction runs (the comm meter).

Rank i's input X_i and upstream gradient G_i are drawn from seeds every rank knows, as small
integers stored in float32, so every sum is exact and each check is ``torch.equal``. Each operator is
its own case of the launch (``run_cases``): one that raises fails only its own tests.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.parallelism import mappings as M
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.launch import launch

from _support import case, run_cases

pytestmark = [pytest.mark.ch04, pytest.mark.timeout(120)]

B, S, H, D = 2, 8, 4, 3  # (batch, sequence, heads or hidden, head dim); S and H divide by 2 and 4


def _ints(shape, seed):
    return torch.randint(-5, 6, shape, generator=torch.Generator().manual_seed(seed)).float()


def _run(op, x, g):
    """y = op(x) and dx for upstream g; the collectives of each direction ({op: calls})."""
    x = x.clone().requires_grad_()
    with comm.meter() as fwd:
        y = op(x)
    with comm.meter() as bwd:
        y.backward(g)
    calls = lambda m: {k: v for k, v in m.calls.items() if v}
    return {"y": y.detach(), "dx": x.grad, "fwd": calls(fwd), "bwd": calls(bwd)}


def _cases():
    """Each operator: (its call, this rank's input, its upstream gradient) — shapes per operator."""
    r, t = dist.get_rank(), dist.get_world_size()
    X = lambda shape: _ints(shape, 100 + r)  # X_r, different on every rank
    G = lambda shape: _ints(shape, 200 + r)  # G_r
    same = lambda shape: _ints(shape, 7)  # a replicated tensor, equal on every rank
    splits_in = [(r + j) % 3 + 1 for j in range(t)]  # rows this rank sends to rank j
    splits_out = [(i + r) % 3 + 1 for i in range(t)]  # rows rank i sends here
    return run_cases({
        "copy_to_tp": lambda: _run(M.copy_to_tp, X((B, S, H)), G((B, S, H))),
        "reduce_from_tp": lambda: _run(M.reduce_from_tp, X((B, S, H)), G((B, S, H))),
        "gather_from_tp": lambda: _run(M.gather_from_tp, X((B, S, H)), G((B, S, H * t))),
        "scatter_to_tp": lambda: _run(M.scatter_to_tp, same((B, S, H * t)), G((B, S, H))),
        "gather_from_sequence": lambda: _run(M.gather_from_sequence, X((B, S // t, H)), G((B, S, H))),
        "reduce_scatter_to_sequence": lambda: _run(M.reduce_scatter_to_sequence, X((B, S, H)),
                                                   G((B, S // t, H))),
        "scatter_to_sequence": lambda: _run(M.scatter_to_sequence, same((B, S, H)), G((B, S // t, H))),
        "seq_to_heads": lambda: _run(M.seq_to_heads, X((B, H, S // t, D)), G((B, H // t, S, D))),
        "heads_to_seq": lambda: _run(M.heads_to_seq, X((B, H // t, S, D)), G((B, H, S // t, D))),
        "all_to_all": lambda: _run(lambda x: M.all_to_all(x, splits_out, splits_in), X((sum(splits_in), D)),
                                   G((sum(splits_out), D))),
    })


@functools.cache
def _results(t):
    return launch(_cases, t, timeout_s=90)


def _all(seed, shape, t):
    return [_ints(shape, seed + i) for i in range(t)]


def _expected(name, r, t):
    """(y, dx) of rank r by each operator's definition (mappings' docstring table)."""
    def seq(i):
        return slice(i * S // t, (i + 1) * S // t)

    def heads(i):
        return slice(i * H // t, (i + 1) * H // t)

    if name == "copy_to_tp":
        return _all(100, (B, S, H), t)[r], sum(_all(200, (B, S, H), t))
    if name == "reduce_from_tp":
        return sum(_all(100, (B, S, H), t)), _all(200, (B, S, H), t)[r]
    if name == "gather_from_tp":
        return torch.cat(_all(100, (B, S, H), t), -1), _all(200, (B, S, H * t), t)[r][..., r * H:(r + 1) * H]
    if name == "scatter_to_tp":
        return _ints((B, S, H * t), 7)[..., r * H:(r + 1) * H], torch.cat(_all(200, (B, S, H), t), -1)
    if name == "gather_from_sequence":
        return torch.cat(_all(100, (B, S // t, H), t), 1), sum(_all(200, (B, S, H), t))[:, seq(r)]
    if name == "reduce_scatter_to_sequence":
        return sum(_all(100, (B, S, H), t))[:, seq(r)], torch.cat(_all(200, (B, S // t, H), t), 1)
    if name == "scatter_to_sequence":
        return _ints((B, S, H), 7)[:, seq(r)], torch.cat(_all(200, (B, S // t, H), t), 1)
    if name == "seq_to_heads":  # X_i: tokens i of Z (B, H, S, D); Y_r: heads r of Z
        Z, dZ = torch.cat(_all(100, (B, H, S // t, D), t), 2), torch.cat(_all(200, (B, H // t, S, D), t), 1)
        return Z[:, heads(r)], dZ[:, :, seq(r)]
    if name == "heads_to_seq":
        Z, dZ = torch.cat(_all(100, (B, H // t, S, D), t), 1), torch.cat(_all(200, (B, H, S // t, D), t), 2)
        return Z[:, :, seq(r)], dZ[:, heads(r)]
    return _expected_all_to_all(r, t)


def _expected_all_to_all(r, t):
    """(y, dx) of rank r for all_to_all: rank i sends rows block j of X_i to rank j, blocks of
    (i + j) % 3 + 1 rows."""
    rows = lambda i, j: (i + j) % 3 + 1
    def block(tensors, i, j):  # block j of rank i's tensor, blocks sized rows(i, ·)
        lo = sum(rows(i, k) for k in range(j))
        return tensors[i][lo:lo + rows(i, j)]
    Xs = [_ints((sum(rows(i, j) for j in range(t)), D), 100 + i) for i in range(t)]
    Gs = [_ints((sum(rows(i, j) for j in range(t)), D), 200 + i) for i in range(t)]
    return torch.cat([block(Xs, i, r) for i in range(t)]), torch.cat([block(Gs, j, r) for j in range(t)])


COLLECTIVES = {  # operator: (forward, backward)
    "copy_to_tp": ({}, {"all_reduce": 1}),
    "reduce_from_tp": ({"all_reduce": 1}, {}),
    "gather_from_tp": ({"all_gather": 1}, {}),
    "scatter_to_tp": ({}, {"all_gather": 1}),
    "gather_from_sequence": ({"all_gather": 1}, {"reduce_scatter": 1}),
    "reduce_scatter_to_sequence": ({"reduce_scatter": 1}, {"all_gather": 1}),
    "scatter_to_sequence": ({}, {"all_gather": 1}),
    "seq_to_heads": ({"all_to_all": 1}, {"all_to_all": 1}),
    "heads_to_seq": ({"all_to_all": 1}, {"all_to_all": 1}),
    "all_to_all": ({"all_to_all": 1}, {"all_to_all": 1}),
}


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_operator_forward_backward_and_its_collectives(t, name):
    for r, res in enumerate(_results(t)):
        got = case(res, name, r)
        y, dx = _expected(name, r, t)
        assert torch.equal(got["y"], y), f"{name} forward, rank {r} of {t}"
        assert torch.equal(got["dx"], dx), f"{name} backward, rank {r} of {t}"
        assert (got["fwd"], got["bwd"]) == COLLECTIVES[name], f"{name} collectives, rank {r}"


def test_checks_name_the_fix():
    with pytest.raises(ValueError, match="n_head 6 is not divisible .* 4"):
        M.heads_per_rank(6, 4)
    with pytest.raises(ValueError, match="hidden size 96 is not divisible by tp=5"):
        M.divide(96, 5, "hidden size")
    with pytest.raises(ValueError, match="dropout 0.1 is not supported here: why; use GPTConfig"):
        M.refuse_dropout(0.1, "why")
    M.refuse_dropout(0.0, "no dropout: nothing to refuse")
    with pytest.raises(RuntimeError, match="launch"):
        M.size_and_rank()
