"""Chapter 03 with the Llama-shaped model: every schedule's pipeline step equals one process.

The executor's stages hold the model's own modules and call its class's ``embed``, ``head`` and
``loss_fn``, so the Llama (rotary positions inside the blocks: no ``wpe``; RMSNorm; SwiGLU; grouped-query
attention) is cut into stages exactly as the GPT is. At p = 2 and 4, for 1F1B, interleaved 1F1B,
ZB-H1, ZB-V and DualPipeV, tied and untied embeddings: the loss and every gradient equal the
single-process step on the same global batch; the stages hold no position table.

Tolerances (derived in tests/_support.py). The steps run in float64. A pipeline sums m microbatch
gradients where one process takes the mean over all rows at once: the same sums in another order, at
most N = max(B·T, f, h) = 256 terms each; the Llama's forward chains 11 steps per block + 2, its loss
and gradients run forward, through the loss and back (tests/test_llama_parallel.py): 2·(11·L + 2) + 2
deep for L = 2p blocks. ``model_bound`` of that, scaled by each tensor's size (at least 1), ~1e-8 at
p = 4. A lost or doubled microbatch moves a gradient by ~1/m of itself, a tied weight's missing
all-reduce by its whole other half. A tied weight's two copies hold one all-reduced sum: bitwise equal.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.llama import Llama, LlamaConfig
from minitorch_dist.parallelism.pipeline import executor as X
from minitorch_dist.parallelism.pipeline.schedules import make_schedule
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import close, float64, model_bound

pytestmark = [pytest.mark.ch03, pytest.mark.timeout(300)]

B, T, V = 16, 16, 64
SEED = 5
CASES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 1), ("dualpipev", 1)]


def _cfg(p: int, tied: bool) -> LlamaConfig:
    return LlamaConfig.tiny(vocab_size=V, block_size=T, n_layer=2 * p, tie_embeddings=tied)


def _batch():
    return MarkovCorpus(V, seed=0).batch(0, B, T)


def _m(name: str, p: int) -> int:
    return 2 * p if name in ("zbv", "dualpipev") else p  # the V schedules' minimum is 2p - 1 and 2p


def _depth(p: int) -> int:
    return 2 * (11 * _cfg(p, False).n_layer + 2) + 2  # forward, the loss, backward (module docstring)


def _n(p: int) -> int:
    cfg = _cfg(p, False)
    return max(B * T, cfg.ffn_hidden, cfg.n_embd)  # the longest reduction: a weight gradient sums B·T rows


def _rank(tied: bool) -> dict:
    with float64():
        return _rank_cases(tied)


def _rank_cases(tied: bool) -> dict:
    p = dist.get_world_size()
    out = {}
    for name, v in CASES:
        torch.manual_seed(SEED)
        model = Llama(_cfg(p, tied))
        sched = make_schedule(name, p, _m(name, p), v)
        stages = X.local_stages(model, sched)
        res = X.run_schedule(sched, stages, *_batch())
        mine = {id(q) for s in stages.values() for q in s.parameters()}
        out[name] = {"loss": res.loss,
                     "grads": {k: q.grad.clone() for k, q in model.named_parameters() if id(q) in mine},
                     "wpe": any(hasattr(s, "wpe") for s in stages.values())}
    return out


@functools.cache
def _ranks(p: int, tied: bool):
    return launch(_rank, p, tied, timeout_s=240)


@functools.cache
def _reference(p: int, tied: bool):
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = Llama(_cfg(p, tied))
        _, loss = model(*_batch())
        loss.backward()
        return loss.item(), {k: q.grad.clone() for k, q in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_a_llama_pipeline_step_equals_one_process(p, tied, name):
    per_rank = _ranks(p, tied)
    want_loss, want = _reference(p, tied)
    losses = [r[name]["loss"] for r in per_rank if r[name]["loss"] is not None]
    assert len(losses) == 1
    loss_bound = model_bound(n=_n(p), depth=_depth(p), scale=max(1.0, abs(want_loss)))
    assert abs(losses[0] - want_loss) <= loss_bound, (losses[0], want_loss, loss_bound)
    got = {}
    for r in per_rank:
        for k, g in r[name]["grads"].items():
            if k in got:  # a tied weight on two ranks: both hold the summed gradient
                torch.testing.assert_close(got[k], g, rtol=0, atol=0)
            got[k] = g
        assert not r[name]["wpe"], "a rotary model has no position table to place on a stage"
    assert got.keys() == want.keys()
    for k in want:
        bound = model_bound(n=_n(p), depth=_depth(p), scale=max(1.0, want[k].abs().max().item()))
        close(got[k], want[k], bound, f"{name} {k}")
