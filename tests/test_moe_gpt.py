"""Chapter 10: the tiny GPT with MoE feed-forwards, and the same model expert-parallel on 2 and 4 ranks.

Independent references: the loss from ``F.cross_entropy`` on the logits plus the load-balancing
formula on each layer's routing; parameter counts from ``costmodel.moe_params`` /
``moe_params_per_token`` with the non-FFN parameters measured on the dense GPT of the same shape.

Expert parallel: rank r trains on rows [r·B/n, (r+1)·B/n) of each global batch, routing them alone;
the reference is the same model in one process run on each rank's rows separately, the losses
summed with weight 1/n (the mean over ranks), then SGD. After 2 steps every replicated parameter
and every expert must equal the reference's.

Tolerances (derived in tests/_support.py). The loss against ``F.cross_entropy`` plus the aux formula:
the same operations on the same tensors, bitwise. Expert parallel against one process runs in
float64: the all-reduce and the all-to-alls add the same terms in another order, at most N = B·T
rows in a replicated weight's gradient, chained 6 deep per block + 2 for the GPT and 3 more per MoE
block (router softmax, expert, combine): ``model_bound(n=128, depth=20)`` for losses, and after STEPS
plain SGD steps of lr LR on gradients within that, ``sgd_bound``: ~1e-11 of the values; a wrong
expert or a missing all-reduce moves parameters by ~lr·grad ≈ 1e-3. Learning: the loss must fall
by 0.3 nats in 20 Adam steps (from log V = 3.47; a router or experts that never learn stay there).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import costmodel
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, MLP, GPTConfig
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch
from minitorch_dist.sparsity.expert_parallel import ExpertParallelMoE, expert_parallel, sync_replicated_grads
from minitorch_dist.sparsity.moe import MoELayer, load_balancing_loss
from minitorch_dist.sparsity.moe_gpt import MoEGPT, MoEGPTConfig

from _support import close, float64, model_bound, sgd_bound

pytestmark = pytest.mark.ch10

SMALL = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, mlp_ratio=2)
B, T, STEPS, LR = 8, 16, 2, 0.1
EP_N, EP_DEPTH = B * T, 6 * SMALL["n_layer"] + 2 + 3 * SMALL["n_layer"]  # see the module docstring


def _cfg(**kw):
    return MoEGPTConfig.tiny(**{**SMALL, **kw})


def test_moe_blocks_replace_every_moe_every_th_mlp():
    m = MoEGPT(_cfg(n_layer=4, moe_every=2))
    assert [type(b.mlp) for b in m.blocks] == [MLP, MoELayer, MLP, MoELayer]
    m = MoEGPT(_cfg(n_layer=3, moe_every=1, router="top2"))
    assert all(isinstance(b.mlp, MoELayer) for b in m.blocks) and len(m.moe_layers()) == 3


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="moe_every 3 > n_layer 2 leaves no MoE block"):
        _cfg(moe_every=3)
    with pytest.raises(ValueError, match="router 'soft' is unknown"):
        _cfg(router="soft")
    with pytest.raises(ValueError, match="n_experts must be a positive int"):
        _cfg(n_experts=0)
    with pytest.raises(ValueError, match="needs an MoEGPTConfig"):
        MoEGPT(GPTConfig(**SMALL))


@pytest.mark.parametrize("router", ["switch", "top2", "topk", "expert_choice"])
def test_loss_is_lm_loss_plus_the_aux_losses(router):
    torch.manual_seed(0)
    m = MoEGPT(_cfg(n_layer=2, moe_every=1, router=router, aux_alpha=0.1)).eval()
    x, y = MarkovCorpus(32).batch(0, 4, 16)
    logits, loss = m(x, y)
    lm = F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))
    aux = 0.0
    for layer in m.moe_layers():
        r = layer.last_routing
        if router != "expert_choice":  # expert choice has no aux loss
            aux = aux + load_balancing_loss(r.probs, r.probs.topk(1, -1).indices[:, 0], 4, 0.1)
    assert torch.equal(m.lm_loss, lm)  # the same operations on the same tensors
    assert torch.equal(loss, lm + aux)
    assert (router == "expert_choice") == (m.aux_loss.item() == 0.0)
    # the load each expert took, and what was dropped, add up to the assignments tried
    k = {"switch": 1, "top2": 2, "topk": 2}.get(router)
    for counts, dropped in zip(m.expert_load(), m.dropped()):
        if k is not None:
            assert int(counts.sum()) + dropped == 4 * 16 * k
        else:
            assert counts.tolist() == [m.moe_layers()[0].last_routing.capacity] * 4


@pytest.mark.parametrize("router,k,noisy", [("switch", 1, False), ("top2", 2, False), ("topk", 2, True)])
def test_total_and_active_parameters_match_the_cost_model(router, k, noisy):
    cfg = _cfg(n_layer=4, moe_every=2, n_experts=8, router=router)
    m = MoEGPT(cfg)
    dense = GPT(cfg)
    mlp = sum(p.numel() for p in dense.blocks[0].mlp.parameters())
    shared = dense.num_params() - cfg.n_layer * mlp  # attention, norms, embeddings
    h, d_ff = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
    common = dict(n_moe_layers=2, n_dense_layers=2, noisy=noisy, shared_params=shared)
    assert m.num_params() == costmodel.moe_params(h, d_ff, 8, **common)
    assert m.active_params_per_token() == costmodel.moe_params_per_token(h, d_ff, 8, k=k, **common)
    assert m.num_params() > dense.num_params() and m.active_params_per_token() < m.num_params()


def test_moe_gpt_learns_and_the_router_gets_a_gradient():
    torch.manual_seed(0)
    m = MoEGPT(_cfg(n_layer=2, moe_every=1))
    corpus = MarkovCorpus(32)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    lm = []
    with single_thread():  # a small model: one thread beats two contending ones
        for step in range(20):
            x, y = corpus.batch(step, 8, 16)
            _, loss = m(x, y)
            opt.zero_grad()
            loss.backward()
            if step == 0:
                assert all(layer.router.w_gate.grad.abs().sum() > 0 for layer in m.moe_layers())
            opt.step()
            lm.append(m.lm_loss.item())
    assert sum(lm[-3:]) / 3 < lm[0] - 0.3  # from log V = 3.47: it learns (module docstring)


# --- expert parallel: the whole model --------------------------------------------------------------


def _model(router):
    torch.manual_seed(3)
    return MoEGPT(_cfg(n_layer=2, moe_every=1, router=router, capacity_factor=1.0))


def _rank_train(router):
    with float64():
        return _rank_train_run(router)


def _rank_train_run(router):
    n, r = dist.get_world_size(), dist.get_rank()
    model = expert_parallel(_model(router))
    corpus, losses = MarkovCorpus(32), []
    for step in range(STEPS):
        x, y = corpus.batch(step, B, T, rank=r, world_size=n)
        _, loss = model(x, y)
        (loss / n).backward()
        sync_replicated_grads(model)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference_train(router, n):
    """Losses per step and rank, the final state, and the largest gradient of any step."""
    model, corpus, losses, grad_size = _model(router), MarkovCorpus(32), [], 0.0
    for step in range(STEPS):
        per_rank = []
        for r in range(n):  # each rank's rows routed alone, as on the ranks
            x, y = corpus.batch(step, B, T, rank=r, world_size=n)
            _, loss = model(x, y)
            (loss / n).backward()
            per_rank.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                grad_size = max(grad_size, p.grad.abs().max().item())
                p -= LR * p.grad
                p.grad = None
        losses.append(per_rank)
    return losses, model.state_dict(), grad_size


def _global_name(name, r, per):
    """blocks.1.mlp.experts.<local i>.… on rank r -> experts.<r·per + i>."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(r * per + int(parts[i]))
    return ".".join(parts)


@pytest.mark.parametrize("n,router", [(2, "switch"), (4, "top2")])
def test_expert_parallel_gpt_trains_like_the_single_process_model(n, router):
    results = launch(_rank_train, n, router, timeout_s=120)
    with float64():
        want_losses, want, grad_size = _reference_train(router, n)
    grad_err = model_bound(n=EP_N, depth=EP_DEPTH, scale=max(1.0, grad_size))
    per = 4 // n
    for r, (losses, state) in enumerate(results):
        for got, step in zip(losses, want_losses, strict=True):
            assert abs(got - step[r]) <= model_bound(n=EP_N, depth=EP_DEPTH, scale=max(1.0, abs(step[r])))
        local = {int(k.split(".")[4]) for k in state if k.startswith("blocks.0.mlp.experts.")}
        assert local == set(range(per))  # only its shard of the 4 experts
        for name, value in state.items():
            assert value.dtype == torch.float64, name
            close(value, want[_global_name(name, r, per)], sgd_bound(steps=STEPS, lr=LR, grad_err=grad_err),
                  f"rank {r} {name}")


def test_expert_parallel_leaves_a_model_without_moe_layers_alone():
    m = GPT(MoEGPTConfig.tiny(**SMALL))  # a dense GPT has no MoE layer: nothing to shard, no group needed
    assert expert_parallel(m) is m
    assert not any(isinstance(x, ExpertParallelMoE) for x in m.modules())
