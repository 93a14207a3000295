"""Wrong: all-reduces the weighted gradients over the whole job instead of the DP group.

For the replicated tensors (LayerNorms, ``wpe``) the tp copies are equal, so the world sum is only
tp times too large; for a TP slice it adds the other ranks' *different* slices into this one.
"""
import torch
import torch.distributed as dist


def train_on_2d_grid_uneven(cfg, dp: int, tp: int, steps: int, batch: int, seq: int, lr: float = 0.1):
    _check_grid_arguments(cfg, dp, tp, steps, batch, seq)
    rank = dist.get_rank()
    dp_rank = rank // tp
    tp_group = dp_group = None
    for first in range(0, dp * tp, tp):
        ranks = list(range(first, first + tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for t in range(tp):
        ranks = list(range(t, dp * tp, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    torch.manual_seed(0)
    model = GPT(cfg)
    if tp > 1:
        model = parallelize_gpt(model, tp_group)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    data = MarkovCorpus(cfg.vocab_size, seed=0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = data.batch(step, batch, seq)
        x, y = x.tensor_split(dp)[dp_rank], y.tensor_split(dp)[dp_rank]
        _, loss = model(x, y)
        loss.backward()
        share = x.size(0) / batch
        for p in params:
            p.grad.mul_(share / tp)
            dist.all_reduce(p.grad)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}
