"""Chapter 05: DeepSpeed-Ulysses attention on sequence shards equals attention on the full sequence,
forward and backward, causal or not, and works the way Jacobs et al. 2023 §3 says: one all-to-all
per tensor (q, k, v in, the output back), the inverse all-to-alls backward, each of
B·n_head·(S/t)·d elements with (t-1)/t of it on the wire.

One launch per degree t runs every case and returns plain data; the tests only inspect it. The
expected values come from elsewhere: ``F.scaled_dot_product_attention`` and the dense
``CausalSelfAttention`` on the whole sequence in one process (one thread, like a rank), sliced
here by this file's own rule (rank r: tokens [r·S/t, (r+1)·S/t), heads [r·n/t, (r+1)·n/t)).

Tolerances (derived in tests/_support.py). Every case runs in float64. The all-to-alls only move
numbers, and each head's attention is the same SDPA call on the same full-sequence rows; but a kernel
may block a batch of fewer heads differently, so outputs and q/k/v gradients are bounded as SDPA's
reductions in another order: at most N = max(B·S, S, D, H) = 32 terms each, chained 5 deep in SDPA's
forward and backward (q·k, the softmax's sum, dO·v, rowsum(dO∘O), dS·k); the wrapped layer adds
c_attn and c_proj, forward and backward (9 deep), and its replicated weights' gradients are t
partial sums over the ranks' tokens added by an all-reduce instead of one sum over B·S rows:
``model_bound``, scaled by each tensor's size (at least 1), below 1e-10. A wrong permutation moves values
by O(1), a missing all-reduce shrinks a weight gradient to ~1/t of itself, a gradient scaled by
1 + 1e-6 already fails. Bytes are counted for float64 (ELEM = 8 bytes an element); a wire total is a
product of a few float64 numbers (rel 1e-12 >> 10 u).

The replicated projections must start equal: built under a different seed on each rank, the layer
still holds rank 0's weights (broadcast when it is built), bitwise, and computes rank 0's layer.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import costmodel
from minitorch_dist.models.gpt import CausalSelfAttention, GPTConfig
from minitorch_dist.parallelism.sequence_parallel import ulysses as U
from minitorch_dist.parallelism.sequence_parallel.ring_attention import shard_sequence
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import case, close, float64, model_bound, refusal, run_cases

pytestmark = pytest.mark.ch05

B, NH, S, D = 2, 4, 16, 8  # n_head divisible by 2 and 4; S by 2 and 4
H = NH * D
CFG = GPTConfig.tiny(vocab_size=32, block_size=S, n_layer=1, n_head=NH, n_embd=H)
SEED = 11
N = max(B * S, S, D, H)  # the longest reduction: a weight gradient sums B·S rows
SDPA_DEPTH, LAYER_DEPTH = 5, 9  # chained reductions: SDPA forward and backward; with c_attn and c_proj
ELEM = 8  # bytes of a float64 element: every case runs in float64


def _shard(x, dim):
    """This rank's S/t consecutive tokens along ``dim`` (the contiguous layout)."""
    return shard_sequence(x, dist.get_world_size(), dist.get_rank(), dim)


def _qkvg():
    g = torch.Generator().manual_seed(SEED)
    return [torch.randn(B, NH, S, D, generator=g) for _ in range(4)]  # q, k, v, and dL/dout


def _module_inputs():
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _dense_attn():
    torch.manual_seed(SEED)
    return CausalSelfAttention(CFG)


def _events(m):
    return [(e.op, e.nbytes, e.wire_bytes, e.group_size) for e in m.events]


# --- what runs on the ranks ---------------------------------------------------------------------


def _attention():
    out = {}
    for causal in (False, True):
        q, k, v, G = (_shard(x, 2) for x in _qkvg())
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        with comm.meter() as fwd:
            y = U.ulysses_attention(q, k, v, causal=causal)
        with comm.meter() as bwd:
            (y * G).sum().backward()
        out[causal] = {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                       "fwd": _events(fwd), "bwd": _events(bwd)}
    return out


def _layout():
    full = _qkvg()[0]
    x = _shard(full, 2)
    heads = U.seq_to_heads(x)
    return {"heads": heads, "round_trip": U.heads_to_seq(heads), "x": x}


def _module():
    x_full, G_full = _module_inputs()
    m = U.UlyssesAttention.from_dense(_dense_attn())
    x = _shard(x_full, 1).requires_grad_(True)
    with comm.meter() as fwd:
        y = m(x)
    with comm.meter() as bwd:
        (y * _shard(G_full, 1)).sum().backward()
    with comm.meter() as sync:
        m.allreduce_gradients()
    return {"y": y.detach(), "dx": x.grad, "grads": {k: p.grad.clone() for k, p in m.named_parameters()},
            "fwd": _events(fwd), "bwd": _events(bwd), "sync": _events(sync)}


def _seeded():
    """Each rank builds the dense attention under its own seed (rank 0's is SEED)."""
    r = dist.get_rank()
    torch.manual_seed(SEED + 1000 * r)
    attn = CausalSelfAttention(CFG)
    built = attn.c_attn.weight.detach().clone()
    m = U.UlyssesAttention.from_dense(attn)
    with torch.no_grad():
        y = m(_shard(_module_inputs()[0], 1))
    return {"built": built, "params": {k: p.detach().clone() for k, p in m.named_parameters()}, "y": y}


def _errors():
    t = dist.get_world_size()
    bad_heads, bad_seq = (3 if t == 2 else 6), 4 * t + 1
    cases = {
        "heads": lambda: U.ulysses_attention(*[torch.randn(1, bad_heads, 4, 2)] * 3),
        "seq_to_heads": lambda: U.seq_to_heads(torch.randn(1, bad_heads, 4, 2)),
        "shard": lambda: U.heads_to_seq(torch.randn(1, 1, bad_seq, 8)),
        "heads_to_seq": lambda: U.heads_to_seq(torch.randn(1, 2, bad_seq, 2)),
        "shapes": lambda: U.ulysses_attention(torch.randn(1, 4, 4, 2), torch.randn(1, 4, 4, 2),
                                              torch.randn(1, 4, 2, 2)),
        "rank": lambda: U.ulysses_attention(*[torch.randn(4, 4, 2)] * 3),
        "module": lambda: U.UlyssesAttention.from_dense(CausalSelfAttention(
            GPTConfig.tiny(n_head=bad_heads, n_embd=4 * bad_heads))),
        "dropout": lambda: U.UlyssesAttention.from_dense(CausalSelfAttention(GPTConfig.tiny(dropout=0.1))),
    }
    return {name: refusal(call) for name, call in cases.items()}


def _run_every_case():
    with float64():
        return run_cases({"attention": _attention, "layout": _layout, "module": _module, "errors": _errors,
                          "seeded": _seeded})


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=120)


def _case(t, name):
    """Each rank's value of case ``name`` on t ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(t))]


# --- the dense references (one process, one thread) -------------------------------------------------


@functools.cache
def _dense_attention(causal):
    with float64(), single_thread():
        q, k, v, G = _qkvg()
        q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        (y * G).sum().backward()
        return {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@functools.cache
def _dense_module():
    with float64(), single_thread():
        x_full, G_full = _module_inputs()
        attn = _dense_attn()
        x = x_full.clone().requires_grad_(True)
        y = attn(x)
        (y * G_full).sum().backward()
        return {"y": y.detach(), "dx": x.grad,
                "grads": {k: p.grad for k, p in attn.named_parameters()
                          if k.startswith(("c_attn", "c_proj"))}}


def _tokens(x, t, r, dim):  # this file's rule: rank r holds the r-th of t equal chunks of the sequence
    return x.chunk(t, dim)[r]


def _close(got, want, where, depth=LAYER_DEPTH):
    """Equal up to the reductions in another order, ``depth`` deep (tests/_support.py)."""
    close(got, want, model_bound(n=N, depth=depth, scale=max(1.0, want.abs().max().item())), where)


# --- equals full attention ------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_attention_equals_full_attention_forward_and_backward(t, causal):
    ref = _dense_attention(causal)
    for r, attention in enumerate(_case(t, "attention")):
        got = attention[causal]
        for key in ("y", "dq", "dk", "dv"):
            _close(got[key], _tokens(ref[key], t, r, 2), f"{key} causal={causal} r={r}", SDPA_DEPTH)


@pytest.mark.parametrize("t", [2, 4])
def test_wrapped_dense_attention_equals_it_on_the_full_sequence(t):
    """Outputs and input gradients on each rank's tokens; weight gradients after the all-reduce."""
    ref = _dense_module()
    for r, got in enumerate(_case(t, "module")):
        _close(got["y"], _tokens(ref["y"], t, r, 1), f"out r={r}")
        _close(got["dx"], _tokens(ref["dx"], t, r, 1), f"dX r={r}")
        assert got["grads"].keys() == ref["grads"].keys()
        for k in ref["grads"]:
            _close(got["grads"][k], ref["grads"][k], f"{k} grad r={r}")


@pytest.mark.parametrize("t", [2, 4])
def test_per_rank_seeds_give_the_first_ranks_dense_layer(t):
    ref = _dense_module()
    with float64(), single_thread():
        want = {k: p.detach() for k, p in _dense_attn().named_parameters()
                if k.startswith(("c_attn", "c_proj"))}
    seeded = _case(t, "seeded")
    assert not torch.equal(seeded[1]["built"], want["c_attn.weight"])  # rank 1's own layer differed
    for r, got in enumerate(seeded):
        assert got["params"].keys() == want.keys()
        for k in want:
            assert torch.equal(got["params"][k], want[k]), f"{k} r={r}"
        _close(got["y"], _tokens(ref["y"], t, r, 1), f"out r={r}")


@pytest.mark.parametrize("t", [2, 4])
def test_layout_transform_gathers_the_sequence_of_this_ranks_heads_and_round_trips(t):
    with float64():
        full, per = _qkvg()[0], NH // t
    for r, lay in enumerate(_case(t, "layout")):
        assert lay["heads"].shape == (B, per, S, D)
        assert torch.equal(lay["heads"], full[:, r * per:(r + 1) * per])  # pure data movement: bitwise
        assert torch.equal(lay["round_trip"], lay["x"])


# --- the mechanism: the all-to-alls and their bytes ----------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_four_all_to_alls_forward_and_four_backward_of_one_shard_each(t):
    """q, k, v to heads and the output back; backward the inverse of each. Bytes per call: a rank's
    whole (B, n_head, S/t, d) shard; wire (t-1)/t of it; total = costmodel.ulysses_bytes_per_layer."""
    shard = B * NH * (S // t) * D * ELEM
    call = ("all_to_all", shard, shard * (t - 1) / t, t)
    for attention, mod in zip(_case(t, "attention"), _case(t, "module"), strict=True):
        for causal in (False, True):
            ev = attention[causal]
            assert ev["fwd"] == [call] * 4
            assert ev["bwd"] == [call] * 4
        assert mod["fwd"] == [call] * 4 and mod["bwd"] == [call] * 4  # the projections add nothing
        wire = sum(e[2] for e in mod["fwd"] + mod["bwd"])
        assert wire == pytest.approx(costmodel.ulysses_bytes_per_layer(B, S, H, t, bytes_per_element=ELEM),
                                     rel=1e-12)
        n_par = sum(p.numel() for p in _dense_attn().parameters())
        per_param = sorted(p.numel() * ELEM for p in _dense_attn().parameters())
        assert sorted(e[1] for e in mod["sync"]) == per_param
        assert sum(e[1] for e in mod["sync"]) == n_par * ELEM


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_bad_shapes_are_clear_errors(t):
    bad_heads, bad_seq = (3 if t == 2 else 6), 4 * t + 1
    for err in _case(t, "errors"):
        heads = (f"n_head {bad_heads} is not divisible by the sequence-parallel degree {t}: "
                 "Ulysses splits heads")
        for name in ("heads", "seq_to_heads", "module"):
            assert err[name] is not None and heads in err[name], name
        seq = f"sequence length {bad_seq} is not divisible by the sequence-parallel degree {t}"
        for name in ("shard", "heads_to_seq"):
            assert err[name] is not None and seq in err[name], name
        assert "q, k, v must have the same shape" in err["shapes"]
        assert "must be (batch, n_head, seq_shard, head_dim)" in err["rank"]
        assert "dropout 0.1 is not supported" in err["dropout"]


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="launch"):
        U.ulysses_attention(*[torch.randn(1, 2, 4, 2)] * 3)

