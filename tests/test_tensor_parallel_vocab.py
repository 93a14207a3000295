"""Chapter 04: the vocabulary-parallel ends of the model compute the dense ones. The embedding split
by vocabulary rows equals ``nn.Embedding``; the cross-entropy on vocabulary-sharded logits equals
``F.cross_entropy`` on the gathered logits, value and gradient, with three all-reduces of b·s
numbers (Shoeybi et al. 2019 §3) and 1/t of the logits kept for backward (MemoryMeter against
``costmodel.vocab_parallel_logits_bytes``).

One launch per t runs every case; the dense references run in this process, one thread like a rank.
Tolerances as in ``test_tensor_parallel.py``: the same sums in another order, float32 ulps apart.
"""
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist.analysis import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.parallelism import tensor_parallel as TP
from minitorch_dist.parallelism import tensor_parallel_vocab as TPV
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch04

B, T, H, V = 4, 16, 32, 64
SEED = 7
ATOL, RTOL = 1e-6, 1e-5


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


def _run_every_case():
    t, r = dist.get_world_size(), dist.get_rank()
    inp, out = _inputs(), {}
    m = TPV.VocabParallelEmbedding.from_dense(_dense_embedding())
    with comm.meter() as fwd:
        y = m(inp["idx"])
    with comm.meter() as bwd:
        (y * inp["G"]).sum().backward()
    out["emb"] = {"y": y.detach(), "grad": m.weight.grad.clone(),
                  "fwd": [(e.op, e.nbytes) for e in fwd.events],
                  "bwd": [(e.op, e.nbytes) for e in bwd.events]}
    logits = inp["logits"].chunk(t, -1)[r].clone().requires_grad_(True)
    with comm.meter() as cm:
        loss = TPV.vocab_parallel_cross_entropy(logits, inp["target"])
    loss.backward()
    gathered = TP.gather_from_tp(logits.detach())
    out["loss"] = {"loss": loss.item(), "grad": logits.grad.clone(), "gathered": gathered,
                   "on_gathered": F.cross_entropy(gathered.reshape(-1, V), inp["target"].reshape(-1)).item(),
                   "events": [(e.op, e.nbytes) for e in cm.events]}
    out["memory"] = _loss_memory(inp["logits"].chunk(t, -1)[r], inp["target"])
    out["ignored"] = {}
    for case, (target, ignore) in inp["ignored"].items():
        z = inp["logits"].chunk(t, -1)[r].clone().requires_grad_(True)
        with comm.meter() as cm:
            loss = TPV.vocab_parallel_cross_entropy(z, target, ignore_index=ignore)
        loss.backward()
        out["ignored"][case] = {"loss": loss.item(), "grad": z.grad.clone(),
                                "events": [(e.op, e.nbytes) for e in cm.events]}
    try:
        TPV.VocabParallelEmbedding(V + 1, H)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=120)


@functools.cache
def _dense():
    with single_thread():
        inp, emb = _inputs(), _dense_embedding()
        y = emb(inp["idx"])
        (y * inp["G"]).sum().backward()
        logits = inp["logits"].clone().requires_grad_(True)
        loss = F.cross_entropy(logits.reshape(-1, V), inp["target"].reshape(-1))
        loss.backward()
        ignored = {}
        for case, (target, ignore) in inp["ignored"].items():
            z = inp["logits"].clone().requires_grad_(True)
            ce = F.cross_entropy(z.reshape(-1, V), target.reshape(-1), ignore_index=ignore)
            ce.backward()
            ignored[case] = {"loss": ce.item(), "grad": z.grad}
        return {"y": y.detach(), "emb_grad": emb.weight.grad, "loss": loss.item(), "logits_grad": logits.grad,
                "ignored": ignored}


def _close(got, want, where):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda s: f"{where}: {s}")


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_embedding_equals_the_dense_embedding(t):
    ref, bsh = _dense(), B * T * H * 4
    for r, res in enumerate(_results(t)):
        e = res["emb"]
        _close(e["y"], ref["y"], f"embedding out r={r}")
        _close(e["grad"], ref["emb_grad"].chunk(t, 0)[r], f"embedding dW (rows of this rank's words) r={r}")
        assert e["fwd"] == [("all_reduce", bsh)], e["fwd"]  # g: one all-reduce of b·s·h forward
        assert e["bwd"] == [], e["bwd"]  # and nothing backward


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_equals_cross_entropy_on_the_gathered_logits(t):
    ref, full = _dense(), _inputs()["logits"]
    for r, res in enumerate(_results(t)):
        lo = res["loss"]
        assert torch.equal(lo["gathered"], full)
        # on_gathered: F.cross_entropy on the gathered logits
        assert lo["loss"] == pytest.approx(lo["on_gathered"], abs=2e-6)
        assert lo["loss"] == pytest.approx(ref["loss"], abs=2e-6)
        _close(lo["grad"], ref["logits_grad"].chunk(t, -1)[r], f"loss dlogits r={r}")


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("case", ["padded", "all", "custom"])
def test_vocab_parallel_loss_ignores_targets_like_cross_entropy(t, case):
    """Positions whose target is ``ignore_index`` add nothing: the loss is the mean over the others
    and their gradient rows are 0, as F.cross_entropy; only padding gives NaN and zero gradients.
    The three all-reduces are unchanged (the ignored positions ride along)."""
    ref = _dense()["ignored"][case]
    counted = _dense()["loss"] if case == "custom" else None
    for r, res in enumerate(_results(t)):
        got = res["ignored"][case]
        if case == "all":
            assert math.isnan(got["loss"]) and math.isnan(ref["loss"])
            assert torch.equal(got["grad"], torch.zeros_like(got["grad"]))
        else:
            assert got["loss"] == pytest.approx(ref["loss"], abs=2e-6)
            _close(got["grad"], ref["grad"].chunk(t, -1)[r], f"dlogits {case} r={r}")
        if counted is not None:
            assert abs(got["loss"] - counted) > 1e-3  # the ignored positions did change the loss
        assert got["events"] == [("all_reduce", B * T * 4)] * 3, got["events"]


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_sends_three_numbers_per_token(t):
    for res in _results(t):
        assert res["loss"]["events"] == [("all_reduce", B * T * 4)] * 3, res["loss"]["events"]


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_keeps_one_t_th_of_the_logits(t):
    """The gathered path saves the full log-softmax (b·s·V), the vocab-parallel one its softmax
    shard (b·s·V/t); both also keep b·s int64 indices (targets, local ids)."""
    want, idx = costmodel.vocab_parallel_logits_bytes(B, T, V, t, bytes_per_element=4), 2 * B * T * 8
    for res in _results(t):
        got = res["memory"]
        assert want["gathered"] <= got["gathered"] <= want["gathered"] + idx
        assert want["vocab_parallel"] <= got["vocab_parallel"] <= want["vocab_parallel"] + idx


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_not_divisible_is_a_clear_error(t):
    for res in _results(t):
        assert f"vocab_size {V + 1} is not divisible by tp={t}" in res["error"]
