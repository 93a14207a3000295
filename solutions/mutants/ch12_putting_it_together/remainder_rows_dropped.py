"""Wrong: gives every replica batch // dp rows and drops the remainder.

Equal shares keep the 1/dp average right, which is why it is tempting; but the rows left over are
never trained on, and the result is not the single process's step on the whole batch.
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
        per = batch // dp
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        _, loss = model(x, y)
        loss.backward()
        for p in params:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}
