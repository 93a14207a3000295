"""Chapter 04: the vocabulary-parallel ends of the model compute the dense ones. The embedding split
by vocabulary rows equals ``nn.Embedding``; the cross-entropy on vocabulary-sharded logits equals
``F.cross_entropy`` on the gathered logits, value and gradient, with three all-reduces of b·s
numbers (Shoeybi et al. 2019 §3) and 1/t of the logits kept for backward (MemoryMeter against
``costmodel.vocab_parallel_logits_bytes``).

One launch per t runs every case; the dense references run in this process, one thread like a rank.

Tolerances (derived in tests/_support.py). Every case runs in float64. The embedding's output is
exact: each position's row comes from the one rank owning its word, the others add zeros (x + 0 = x
in any order), so it is compared with ``torch.equal``. Its weight gradient sums the G rows of each
word's positions, at most B·T = 64 of them, on the owning rank as in ``nn.Embedding`` (the other
positions add zeros): one sum in another order, ``reorder_bound(B·T, Σ_positions |G|)``. The loss is
a short chain of two reductions (the log-sum-exp over V = 64 logits, split over the ranks, then the
mean over B·T = 64 tokens): ``model_bound(n=64, depth=2)``, scaled by 2·max|logits| (bounds every
z = logit - max and every token's loss, log V + |z_target|), ~1e-9; its gradient
(softmax - onehot) / count, with the same chain: ``model_bound`` scaled by the largest entry
(1/count). A lost 1/t, an all-reduce missing or a shard read from the wrong words moves a loss by
O(1) and a gradient by O(1/count) = O(1e-2). Bytes are counted for float64 (ELEM = 8 bytes an
element, int64 indices 8 too).
"""
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.parallelism import tensor_parallel as TP
from minitorch_dist.parallelism import tensor_parallel_vocab as TPV
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import case, close, float64, model_bound, refusal, reorder_bound, run_cases

pytestmark = pytest.mark.ch04

B, T, H, V = 4, 16, 32, 64
SEED = 7
N, LOSS_DEPTH = max(V, B * T), 2  # the loss: a log-sum-exp over V logits, then a mean over B·T tokens
ELEM = 8  # bytes of a float64 element: every case runs in float64


def _inputs():
    g = torch.Generator().manual_seed(SEED + 1)
    idx = torch.randint(0, V, (B, T), generator=g)
    idx[0, :4] = torch.tensor([0, V // 4 - 1, V // 4, V - 1])  # the edges of the shards
    target = torch.randint(0, V, (B, T), generator=g)
    padded = target.clone()
    padded[0, T // 2:], padded[3] = -100, -100  # padding: F.cross_entropy's default ignore_index
    other = target.clone()
    other[1, :5] = 7  # a custom ignore_index, here a real token id
    return {"idx": idx, "G": torch.randn(B, T, H, generator=g),
            "logits": 3 * torch.randn(B, T, V, generator=g), "target": target,
            "ignored": {"padded": (padded, -100), "all": (torch.full_like(target, -100), -100),
                        "custom": (other, 7)}}


def _dense_embedding():
    torch.manual_seed(SEED)
    return nn.Embedding(V, H)


# --- what runs on the ranks ---------------------------------------------------------------------


def _loss_memory(logits_local, target):
    """Bytes the loss keeps for backward: gather-then-F.cross_entropy against the vocab-parallel loss."""
    out = {}
    for name in ("gathered", "vocab_parallel"):
        z = logits_local.clone().requires_grad_(True)
        meter = MemoryMeter()
        with meter.track():
            if name == "gathered":
                loss = F.cross_entropy(TP.gather_from_tp(z).reshape(-1, V), target.reshape(-1))
            else:
                loss = TPV.vocab_parallel_cross_entropy(z, target)
            loss.backward()
        out[name] = meter.peak["activations"]
    return out


def _embedding():
    inp = _inputs()
    m = TPV.VocabParallelEmbedding.from_dense(_dense_embedding())
    with comm.meter() as fwd:
        y = m(inp["idx"])
    with comm.meter() as bwd:
        (y * inp["G"]).sum().backward()
    return {"y": y.detach(), "grad": m.weight.grad.clone(),
            "fwd": [(e.op, e.nbytes) for e in fwd.events], "bwd": [(e.op, e.nbytes) for e in bwd.events]}


def _loss():
    t, r, inp = dist.get_world_size(), dist.get_rank(), _inputs()
    logits = inp["logits"].chunk(t, -1)[r].clone().requires_grad_(True)
    with comm.meter() as cm:
        loss = TPV.vocab_parallel_cross_entropy(logits, inp["target"])
    loss.backward()
    gathered = TP.gather_from_tp(logits.detach())
    return {"loss": loss.item(), "grad": logits.grad.clone(), "gathered": gathered,
            "on_gathered": F.cross_entropy(gathered.reshape(-1, V), inp["target"].reshape(-1)).item(),
            "events": [(e.op, e.nbytes) for e in cm.events]}


def _ignored():
    t, r, inp, out = dist.get_world_size(), dist.get_rank(), _inputs(), {}
    for kind, (target, ignore) in inp["ignored"].items():
        z = inp["logits"].chunk(t, -1)[r].clone().requires_grad_(True)
        with comm.meter() as cm:
            loss = TPV.vocab_parallel_cross_entropy(z, target, ignore_index=ignore)
        loss.backward()
        out[kind] = {"loss": loss.item(), "grad": z.grad.clone(),
                     "events": [(e.op, e.nbytes) for e in cm.events]}
    return out


def _run_every_case():
    t, r = dist.get_world_size(), dist.get_rank()
    with float64():
        return run_cases({
            "emb": _embedding, "loss": _loss,
            "memory": lambda: _loss_memory(_inputs()["logits"].chunk(t, -1)[r], _inputs()["target"]),
            "ignored": _ignored, "error": lambda: refusal(lambda: TPV.VocabParallelEmbedding(V + 1, H))})


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=120)


def _case(t, name):
    """Each rank's value of case ``name`` on t ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(t))]


@functools.cache
def _dense():
    with float64(), single_thread():
        inp, emb = _inputs(), _dense_embedding()
        y = emb(inp["idx"])
        (y * inp["G"]).sum().backward()
        logits = inp["logits"].clone().requires_grad_(True)
        loss = F.cross_entropy(logits.reshape(-1, V), inp["target"].reshape(-1))
        loss.backward()
        ignored = {}
        for kind, (target, ignore) in inp["ignored"].items():
            z = inp["logits"].clone().requires_grad_(True)
            ce = F.cross_entropy(z.reshape(-1, V), target.reshape(-1), ignore_index=ignore)
            ce.backward()
            ignored[kind] = {"loss": ce.item(), "grad": z.grad}
        return {"y": y.detach(), "emb_grad": emb.weight.grad, "loss": loss.item(), "logits_grad": logits.grad,
                "ignored": ignored, "G_sum": inp["G"].abs().sum((0, 1)),
                "logits_max": inp["logits"].abs().max()}


def _loss_close(got, want):
    """A loss: the chain log-sum-exp over V, mean over B·T, on values up to 2·max|logits|."""
    bound = model_bound(n=N, depth=LOSS_DEPTH, scale=2 * _dense()["logits_max"])
    assert abs(got - want) <= bound, f"loss {got} vs {want}: |diff| {abs(got - want):.3g} > bound {bound:.3g}"


def _dlogits_close(got, want, where):
    """dloss/dlogits = (softmax - onehot) / count: the same chain, scaled by its largest entry."""
    close(got, want, model_bound(n=N, depth=LOSS_DEPTH, scale=want), where)


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_embedding_equals_the_dense_embedding(t):
    ref, bsh = _dense(), B * T * H * ELEM
    for r, e in enumerate(_case(t, "emb")):
        assert torch.equal(e["y"], ref["y"]), f"embedding out r={r}"  # one row + zeros: exact
        close(e["grad"], ref["emb_grad"].chunk(t, 0)[r], reorder_bound(B * T, ref["G_sum"], torch.float64),
              f"embedding dW (rows of this rank's words) r={r}")
        assert e["fwd"] == [("all_reduce", bsh)], e["fwd"]  # g: one all-reduce of b·s·h forward
        assert e["bwd"] == [], e["bwd"]  # and nothing backward


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_equals_cross_entropy_on_the_gathered_logits(t):
    with float64():
        ref, full = _dense(), _inputs()["logits"]  # the ranks' logits: drawn in float64 as there
    for r, lo in enumerate(_case(t, "loss")):
        assert torch.equal(lo["gathered"], full)
        # on_gathered: F.cross_entropy on the gathered logits
        _loss_close(lo["loss"], lo["on_gathered"])
        _loss_close(lo["loss"], ref["loss"])
        _dlogits_close(lo["grad"], ref["logits_grad"].chunk(t, -1)[r], f"loss dlogits r={r}")


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("kind", ["padded", "all", "custom"])
def test_vocab_parallel_loss_ignores_targets_like_cross_entropy(t, kind):
    """Positions whose target is ``ignore_index`` add nothing: the loss is the mean over the others
    and their gradient rows are 0, as F.cross_entropy; only padding gives NaN and zero gradients.
    The three all-reduces are unchanged (the ignored positions ride along)."""
    ref = _dense()["ignored"][kind]
    counted = _dense()["loss"] if kind == "custom" else None
    for r, ignored in enumerate(_case(t, "ignored")):
        got = ignored[kind]
        if kind == "all":
            assert math.isnan(got["loss"]) and math.isnan(ref["loss"])
            assert torch.equal(got["grad"], torch.zeros_like(got["grad"]))
        else:
            _loss_close(got["loss"], ref["loss"])
            _dlogits_close(got["grad"], ref["grad"].chunk(t, -1)[r], f"dlogits {kind} r={r}")
        if counted is not None:
            assert abs(got["loss"] - counted) > 1e-3  # the ignored positions did change the loss
        assert got["events"] == [("all_reduce", B * T * ELEM)] * 3, got["events"]


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_sends_three_numbers_per_token(t):
    for lo in _case(t, "loss"):
        assert lo["events"] == [("all_reduce", B * T * ELEM)] * 3, lo["events"]


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_keeps_one_t_th_of_the_logits(t):
    """The gathered path saves the full log-softmax (b·s·V), the vocab-parallel one its softmax
    shard (b·s·V/t); both also keep b·s int64 indices (targets, local ids)."""
    want, idx = costmodel.vocab_parallel_logits_bytes(B, T, V, t, bytes_per_element=ELEM), 2 * B * T * 8
    for got in _case(t, "memory"):
        assert want["gathered"] <= got["gathered"] <= want["gathered"] + idx
        assert want["vocab_parallel"] <= got["vocab_parallel"] <= want["vocab_parallel"] + idx


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_not_divisible_is_a_clear_error(t):
    for err in _case(t, "error"):
        assert f"vocab_size {V + 1} is not divisible by tp={t}" in err
