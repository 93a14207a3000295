"""Chapters 01, 04, 05, 06 with the Llama: every wrapper computes the single-process Llama on the same
global batch, at 2 and 4 ranks. DDP (ours and torch's), ``fully_shard`` (ours and torch's FSDP2, the
blocks as units), Megatron TP with the kv heads split (t | n_kv_head) and replicated (n_kv_head | t),
Megatron SP (RMSNorm on the sequence slice), Ulysses (t | n_kv_head, else a clear error) and ring
attention with fewer kv than query heads. And the mechanism: TP's 2 + 2 all-reduces of b·s·h per layer
(q|k|v and gate|up behind one f each) plus, with replicated kv heads, one all-reduce of the k, v weight
gradients; SP's all-gathers and reduce-scatters; Ulysses' k, v all-to-alls n_head/n_kv_head times
smaller than q's.

One launch per degree t runs every case and returns plain data; the tests only inspect it. Expected
values come from elsewhere: the dense Llama trained in this process (one thread, like a rank),
``F.scaled_dot_product_attention(enable_gqa=True)``, and this file's own slicing rule (rank r: query
heads [r·a/t, (r+1)·a/t); kv heads [r·g/t, (r+1)·g/t) when t <= g, else the one kv head
(r·a/t) // (a/g) its query heads read; gate/up rows and o/down columns in t blocks; vocabulary rows).

Tolerances (derived in tests/_support.py). Every case runs in float64. The wrappers add partial sums
(over ranks, heads, sequence slices, microbatch rows) where one process adds in one pass: the same sums
in another order, at most N = max(B·T, f, h) = 96 terms each. The Llama's forward chains 11 steps per
block (tests/test_llama.py: RMSNorm, q/k/v, RoPE on q and on k, the scores, the softmax's sum, p·v,
o_proj, RMSNorm, gate/up, down) and 2 more (ln_f, lm_head); its loss and gradients run forward, through
the loss (2) and back: LLAMA_DEPTH = 2·(11·L + 2) + 2 = 50. Losses and last-step gradients:
``model_bound`` of that, scaled by the values' size (at least 1); weights after STEPS - 1 = 2 SGD
steps (lr 0.1, momentum 0.9): ``sgd_bound`` of the gradients' bound, ~1e-9. One attention layer
(q/k/v, RoPE on q and k, SDPA's 5 chained reductions, o_proj, and backward's input and weight
gradients: ATTN_DEPTH = 11), and ring attention alone (SDPA's 5 and the merge: 6), likewise with their
own sizes. A replicated kv head whose gradient is not summed over its copies holds 1/2 (t/g = 2) or 1/4
of it, a lost 1/n or all-reduce moves a weight by ~lr·|g| ~ 1e-3: far outside. Bytes are counted for
float64 (ELEM = 8 bytes an element); a wire total is a product of a few float64 numbers (rel 1e-12
>> 10 u).
"""
import collections
import functools

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist.costmodel.llama import llama_params_per_rank, ulysses_bytes_per_layer_gqa
from minitorch_dist.memory.zero.fsdp import full_state_dict, fully_shard
from minitorch_dist.models.llama import Llama, LlamaConfig, apply_rope, split_heads
from minitorch_dist.models.train import train_steps
from minitorch_dist.parallelism import data_parallel as DP
from minitorch_dist.parallelism import tensor_parallel_llama as TPL
from minitorch_dist.parallelism.sequence_parallel import megatron_sp as SP
from minitorch_dist.parallelism.sequence_parallel import ulysses as U
from minitorch_dist.parallelism.sequence_parallel.ring_attention import (
    ring_attention,
    sequence_positions,
    shard_sequence,
)
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import case, close, dense_run, float64, model_bound, refusal, run_cases, sgd_bound

pytestmark = [pytest.mark.ch04, pytest.mark.ch05, pytest.mark.timeout(300)]

B, T, H, V = 4, 16, 32, 64
CFGS = {  # rope_theta 10,000: at T = 16 the 500,000 of Llama 3 would barely turn the low pairs
    "gqa": LlamaConfig.tiny(vocab_size=V, block_size=T, n_head=4, n_kv_head=2, n_embd=H, rope_theta=1e4),
    "mqa": LlamaConfig.tiny(vocab_size=V, block_size=T, n_head=4, n_kv_head=1, n_embd=H, rope_theta=1e4),
    "gqa8": LlamaConfig.tiny(vocab_size=V, block_size=T, n_head=8, n_kv_head=4, n_embd=H, rope_theta=1e4),
}
STEPS, LR, SEED = 3, 0.1, 7
N = max(B * T, *(c.ffn_hidden for c in CFGS.values()), H)  # the longest reduction (SwiGLU's down: f = 96)
LLAMA_DEPTH = 2 * (11 * CFGS["gqa"].n_layer + 2) + 2  # forward, the loss, backward (module docstring)
ATTN_DEPTH, RING_DEPTH = 11, 6  # one attention layer forward and backward; ring attention alone
ELEM = 8  # bytes of a float64 element: every case runs in float64


def _layout(cfg, t):  # this file's rule
    return "split" if t <= cfg.n_kv_head else "replicated"


# --- what runs on the ranks ---------------------------------------------------------------------


def _ev(m):
    return [(e.op, e.nbytes) for e in m.events]


def _dp_cases():
    """DDP and FSDP, ours and torch's: each rank trains on its B/n rows of every step's batch."""
    r, n, out = dist.get_rank(), dist.get_world_size(), {}
    wrappers = {"ddp": lambda m: DP.DistributedDataParallel(m, bucket_cap_mb=0.05),
                "torch_ddp": lambda m: nn.parallel.DistributedDataParallel(m),
                "fsdp": lambda m: _shard_blocks(m, fully_shard),
                "torch_fsdp": lambda m: _shard_blocks(m, _torch)}
    for name, wrap in wrappers.items():
        torch.manual_seed(SEED)
        model = wrap(Llama(CFGS["gqa"]))
        run = train_steps(model, STEPS, B, T, lr=LR, momentum=0.9, rank=r, world_size=n)
        if name == "fsdp":
            params = full_state_dict(model)
        elif name == "torch_fsdp":
            params = {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}
        else:
            params = {k.removeprefix("module."): p.detach().clone() for k, p in model.named_parameters()}
        out[name] = {"losses": run.losses, "params": params}
    return out


def _shard_blocks(model, shard):
    for block in model.blocks:
        shard(block)
    return shard(model)


def _torch(module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return torch_fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def _tp_cases(sequence_parallel):
    """STEPS SGD steps of the TP (or TP + SP) Llama for every config whose heads t splits; one block's
    forward / backward collectives; with SP the RMSNorm gradients before their all-reduce."""
    t, out = dist.get_world_size(), {}
    for name, cfg in CFGS.items():
        torch.manual_seed(SEED)
        model = TPL.parallelize_llama(Llama(cfg), sequence_parallel=sequence_parallel)
        partial = {}

        def after(model=model, partial=partial):
            partial.update({k: p.grad.clone() for k, p in model.named_parameters() if "ln_" in k})
            SP.allreduce_sequence_parallel_grads(model)

        run = train_steps(model, STEPS, B, T, lr=LR, momentum=0.9, after_backward=after if sequence_parallel
                          else None)
        out[name] = {"losses": run.losses, "partial": partial, "layout": model.blocks[0].attn.kv_layout,
                     "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
                     "params": {k: p.detach().clone() for k, p in model.named_parameters()}}
        x = torch.randn(B, T // t if sequence_parallel else T, H, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        with comm.meter() as fwd:
            y = model.blocks[0](x)
        with comm.meter() as bwd:
            y.sum().backward()
        out[name]["block"] = {"fwd": _ev(fwd), "bwd": _ev(bwd)}
    return out


def _attention_inputs(seed=SEED + 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)


def _dense_attention(cfg):
    torch.manual_seed(SEED)
    return Llama(cfg).blocks[0].attn


def _ulysses_cases():
    t, r, out = dist.get_world_size(), dist.get_rank(), {}
    name = "gqa" if t == 2 else "gqa8"  # t | n_kv_head
    m = U.UlyssesGQAAttention(_dense_attention(CFGS[name]))
    x_full, g_full = _attention_inputs()
    x = x_full.chunk(t, 1)[r].clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = m(x)
    (y * g_full.chunk(t, 1)[r]).sum().backward()
    m.allreduce_gradients()
    out[name] = {"y": y.detach(), "dx": x.grad, "grads": {k: p.grad for k, p in m.named_parameters()},
                 "fwd": _ev(fwd)}
    return out


def _ring_cases():
    """ring_attention on GQA shards (both layouts, causal or not), and a Llama attention layer on ring
    attention: RoPE at the shard's global positions (``sequence_positions``), then the ring."""
    t, r, out = dist.get_world_size(), dist.get_rank(), {}
    g = torch.Generator().manual_seed(SEED + 2)
    q, dout = torch.randn(B, 4, T, 8, generator=g), torch.randn(B, 4, T, 8, generator=g)
    for n_kv in (2, 1):
        k, v = torch.randn(B, n_kv, T, 8, generator=g), torch.randn(B, n_kv, T, 8, generator=g)
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                qs, ks, vs = (shard_sequence(u, t, r, 2, layout).requires_grad_(True) for u in (q, k, v))
                y = ring_attention(qs, ks, vs, causal=causal, layout=layout)
                (y * shard_sequence(dout, t, r, 2, layout)).sum().backward()
                out[n_kv, layout, causal] = {"y": y.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    attn, (x_full, _) = _dense_attention(CFGS["gqa"]), _attention_inputs()
    x = shard_sequence(x_full, t, r, 1, "zigzag")
    qkv = (split_heads(p(x), attn.head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    pos = sequence_positions(T, t, r, "zigzag")
    qh, kh, vh = (apply_rope(u, pos, attn.rope_theta) if i < 2 else u for i, u in enumerate(qkv))
    y = ring_attention(qh, kh, vh, causal=True, layout="zigzag")
    out["layer"] = attn.o_proj(y.transpose(1, 2).flatten(2)).detach()
    return out


def _errors():
    t = dist.get_world_size()
    bad = LlamaConfig.tiny(n_head=6, n_kv_head=3, n_embd=48) if t == 2 else LlamaConfig.tiny(
        n_head=12, n_kv_head=6, n_embd=48)
    return {"tp": refusal(lambda: TPL.parallelize_llama(Llama(bad))),
            "ulysses": refusal(lambda: U.UlyssesGQAAttention(_dense_attention(CFGS["mqa" if t == 2
                                                                                   else "gqa"])))}


def _run_every_case():
    with float64():
        return run_cases({"dp": _dp_cases, "tp": lambda: _tp_cases(False), "sp": lambda: _tp_cases(True),
                          "ulysses": _ulysses_cases, "ring": _ring_cases, "errors": _errors})


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=240)


def _case(t, name):
    """Each rank's value of case ``name`` on t ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(t))]


# --- the dense references (one process, one thread) and this file's slicing rule --------------------------


@functools.cache
def _dense(name):
    with float64():
        return dense_run(lambda: Llama(CFGS[name]), STEPS, B, T, seed=SEED, lr=LR, momentum=0.9)


@functools.cache
def _dense_attention_run(name):
    with float64(), single_thread():
        attn = _dense_attention(CFGS[name])
        x_full, g_full = _attention_inputs()
        x = x_full.clone().requires_grad_(True)
        y = attn(x)
        (y * g_full).sum().backward()
        return {"y": y.detach(), "dx": x.grad, "grads": {k: p.grad for k, p in attn.named_parameters()}}


def _shard(name, w, cfg, t, r):
    """Rank r's part of the dense tensor ``w`` named ``name`` (this file's rule, module docstring)."""
    a, g, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        heads = w.view(g, d, w.size(1))
        if t <= g:
            return heads.chunk(t, 0)[r].reshape(-1, w.size(1))
        return heads[(r * a // t) // (a // g)]
    if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")) or name in ("wte.weight",
                                                                                          "lm_head.weight"):
        return w.chunk(t, 0)[r]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return w.chunk(t, 1)[r]
    return w  # RMSNorm gains: whole on every rank


def _close(got, want, where, depth=LLAMA_DEPTH):
    """Equal up to the reductions in another order, ``depth`` deep (tests/_support.py)."""
    close(got, want, model_bound(n=N, depth=depth, scale=max(1.0, want.abs().max().item())), where)


def _close_params(got, want, grads, where):
    """Weights after STEPS - 1 SGD steps, each on gradients within the Llama's ``model_bound``."""
    grad_err = model_bound(n=N, depth=LLAMA_DEPTH, scale=max(1.0, max(g.abs().max().item() for g in grads)))
    close(got, want, sgd_bound(steps=STEPS - 1, lr=LR, grad_err=grad_err, momentum=0.9), where)


def _close_losses(got, want):
    for a, b in zip(got, want, strict=True):
        bound = model_bound(n=N, depth=LLAMA_DEPTH, scale=max(1.0, abs(b)))
        assert abs(a - b) <= bound, f"loss {a} vs {b}: |diff| {abs(a - b):.3g} > bound {bound:.3g}"


# --- data parallel: DDP and fully_shard, ours and torch's --------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("wrapper", ["ddp", "torch_ddp", "fsdp", "torch_fsdp"])
def test_data_parallel_wrappers_equal_one_process(t, wrapper):
    ref = _dense("gqa")
    res = _case(t, "dp")
    global_losses = [sum(step) / t for step in zip(*(dp[wrapper]["losses"] for dp in res))]
    _close_losses(global_losses, ref["losses"])
    for r, dp in enumerate(res):
        got = dp[wrapper]["params"]
        assert got.keys() == ref["params"].keys()
        for k in ref["params"]:
            _close_params(got[k], ref["params"][k], ref["grads"].values(), f"{wrapper} t={t} r={r} {k}")


@pytest.mark.parametrize("t", [2, 4])
def test_ours_equal_torch_ddp_and_fsdp2(t):
    grads = _dense("gqa")["grads"].values()  # the gradients' size, for the weights' bound
    for dp in _case(t, "dp"):
        for ours, theirs in (("ddp", "torch_ddp"), ("fsdp", "torch_fsdp")):
            _close_losses(dp[ours]["losses"], dp[theirs]["losses"])
            for k, w in dp[theirs]["params"].items():
                _close_params(dp[ours]["params"][k], w, grads, f"{ours} vs {theirs} {k}")


# --- Megatron TP and SP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", sorted(CFGS))
def test_tensor_and_sequence_parallel_llama_equal_one_process(t, sp, name):
    """Losses, last-step gradients and weights after STEPS - 1 updates, shard by shard; the kv heads
    split or replicated as this file's rule says (gqa: split at 2, replicated at 4; mqa: replicated)."""
    cfg, ref = CFGS[name], _dense(name)
    for r, rank in enumerate(_case(t, "sp" if sp else "tp")):
        got = rank[name]
        assert got["layout"] == _layout(cfg, t)
        _close_losses(got["losses"], ref["losses"])
        assert got["grads"].keys() == ref["grads"].keys()
        for k in ref["grads"]:
            where = f"{name} sp={sp} t={t} r={r} {k}"
            _close(got["grads"][k], _shard(k, ref["grads"][k], cfg, t, r), f"grads {where}")
            _close_params(got["params"][k], _shard(k, ref["params"][k], cfg, t, r), ref["grads"].values(),
                          f"params {where}")


@pytest.mark.parametrize("t", [2, 4])
def test_each_rank_holds_the_parameters_the_costmodel_counts(t):
    for name, cfg in CFGS.items():
        for tp in _case(t, "tp"):
            held = sum(p.numel() for p in tp[name]["params"].values())
            assert held == llama_params_per_rank(cfg, t), name


@pytest.mark.parametrize("t", [2, 4])
def test_replicated_kv_heads_gradients_are_summed_over_their_copies(t):
    """Each copy of a kv head holds its whole gradient (the sum over the t/g ranks sharing it), not this
    rank's part: the part alone would be 1/(t/g) of it. Copies of one head stay bitwise equal."""
    for name in ("mqa",) + (("gqa",) if t == 4 else ()):
        cfg, ref, res = CFGS[name], _dense(name), _case(t, "tp")
        k = "blocks.1.attn.k_proj.weight"
        want = [_shard(k, ref["grads"][k], cfg, t, r) for r in range(t)]
        for r, tp in enumerate(res):
            _close(tp[name]["grads"][k], want[r], f"{name} t={t} r={r}")
            assert (tp[name]["grads"][k] - want[r] / (t // cfg.n_kv_head)).abs().max() > 1e-4
        copies = collections.defaultdict(list)
        for r, tp in enumerate(res):
            head = (r * cfg.n_head // t) // (cfg.n_head // cfg.n_kv_head)
            copies[head].append(tp[name]["params"][k])
        assert all(len(c) == t // cfg.n_kv_head for c in copies.values())
        assert all(torch.equal(c[0], ci) for c in copies.values() for ci in c)


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_rmsnorm_gradients_are_partial_until_summed(t):
    ref, res = _dense("gqa"), _case(t, "sp")
    for r, sp in enumerate(res):
        got = sp["gqa"]
        for k, partial in got["partial"].items():
            assert (partial - ref["grads"][k]).abs().max() > 1e-4, k  # this rank's s/t positions only
        total = sum(x["gqa"]["partial"]["ln_f.weight"] for x in res)
        _close(total, ref["grads"]["ln_f.weight"], f"sum of partials r={r}")


@pytest.mark.parametrize("t", [2, 4])
def test_a_layer_costs_two_plus_two_allreduces_and_the_kv_copies_one_more(t):
    """TP: f before q|k|v and before gate|up (one all-reduce each backward), g after o_proj and down_proj
    (one each forward), all of b·s·h; replicated kv heads add one all-reduce of 2·g·d·h weight gradients.
    SP: the same bytes as all-gathers and reduce-scatters (re-gathering for the weight gradients)."""
    bsh = B * T * H * ELEM
    for tp_rank, sp_rank in zip(_case(t, "tp"), _case(t, "sp"), strict=True):
        for name, cfg in CFGS.items():
            ev = tp_rank[name]["block"]
            assert ev["fwd"] == [("all_reduce", bsh)] * 2
            kv_sum = [("all_reduce", 2 * cfg.n_kv_head * cfg.head_dim * H * ELEM)]
            extra = kv_sum if _layout(cfg, t) == "replicated" else []
            assert sorted(ev["bwd"]) == sorted([("all_reduce", bsh)] * 2 + extra), name
            sp = sp_rank[name]["block"]
            assert sorted(sp["fwd"]) == [("all_gather", bsh)] * 2 + [("reduce_scatter", bsh)] * 2
            want = [("all_gather", bsh)] * 4 + [("reduce_scatter", bsh)] * 2 + extra
            assert sorted(sp["bwd"]) == sorted(want)


# --- Ulysses and ring attention with grouped-query attention ---------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_ulysses_gqa_attention_equals_the_dense_layer(t):
    name = "gqa" if t == 2 else "gqa8"
    cfg, ref = CFGS[name], _dense_attention_run(name)
    shard = B * (T // t) * cfg.head_dim * ELEM
    for r, ulysses in enumerate(_case(t, "ulysses")):
        got = ulysses[name]
        _close(got["y"], ref["y"].chunk(t, 1)[r], f"y r={r}", ATTN_DEPTH)
        _close(got["dx"], ref["dx"].chunk(t, 1)[r], f"dx r={r}", ATTN_DEPTH)
        for k in ref["grads"]:
            _close(got["grads"][k], ref["grads"][k], f"{k} r={r}", ATTN_DEPTH)
        # q and the output: n_head heads of this rank's tokens; k and v: n_kv_head heads, a/g times smaller
        assert sorted(got["fwd"]) == sorted([("all_to_all", cfg.n_head * shard)] * 2
                                            + [("all_to_all", cfg.n_kv_head * shard)] * 2)
        wire = 2 * sum(n * (t - 1) / t for _, n in got["fwd"])  # backward: the same transfers reversed
        want = ulysses_bytes_per_layer_gqa(B, T, cfg.n_head, cfg.n_kv_head, cfg.head_dim, t, ELEM)
        assert wire == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("t", [2, 4])
def test_ring_attention_takes_fewer_kv_heads(t):
    ring = _case(t, "ring")
    with float64():
        g = torch.Generator().manual_seed(SEED + 2)
        q, dout = torch.randn(B, 4, T, 8, generator=g), torch.randn(B, 4, T, 8, generator=g)
        for n_kv in (2, 1):
            k, v = torch.randn(B, n_kv, T, 8, generator=g), torch.randn(B, n_kv, T, 8, generator=g)
            for causal in (False, True):
                qq, kk, vv = (u.clone().requires_grad_(True) for u in (q, k, v))
                y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)
                (y * dout).sum().backward()
                want = {"y": y.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
                for layout in ("contiguous", "zigzag"):
                    for r, rank in enumerate(ring):
                        got = rank[n_kv, layout, causal]
                        for key, w in want.items():
                            want_r = shard_sequence(w, t, r, 2, layout)
                            _close(got[key], want_r, f"{key} kv={n_kv} {layout} causal={causal}", RING_DEPTH)


@pytest.mark.parametrize("t", [2, 4])
def test_a_llama_attention_layer_runs_on_ring_attention(t):
    want = _dense_attention_run("gqa")["y"]
    for r, ring in enumerate(_case(t, "ring")):
        _close(ring["layer"], shard_sequence(want, t, r, 1, "zigzag"), f"r={r}", ATTN_DEPTH)


# --- what is refused, and how ----------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_degrees_that_split_no_whole_heads_are_clear_errors(t):
    err = _case(t, "errors")[0]
    a, g = (6, 3) if t == 2 else (12, 6)
    assert err["tp"] is not None and f"n_head={a}, n_kv_head={g}, t={t}; use t in" in err["tp"]
    assert "t dividing n_kv_head (kv heads split) or n_kv_head dividing t (kv heads replicated)" in err["tp"]
    kv = 1 if t == 2 else 2
    ok = (1,) if t == 2 else (1, 2)
    assert err["ulysses"] == (f"Ulysses needs t <= n_kv_head and t dividing n_kv_head: n_kv_head={kv}, "
                              f"t={t}; use t in {ok} or ring attention (its all-to-all of k, v can only hand "
                              f"out whole kv heads)")
