"""Wrong: spreads the smoothing over the V - 1 tokens other than the target.

The other common definition of label smoothing; PyTorch's, and the one asked for, spreads it over all
V tokens, the target included. The two differ by smoothing·(z_y - mean z)/(V - 1) per row.
"""


def vocab_sharded_smoothed_ce(logits_r: torch.Tensor, targets: torch.Tensor, smoothing: float,
                              group=None) -> torch.Tensor:
    _require_dist("vocab_sharded_smoothed_ce")
    if tuple(targets.shape) != tuple(logits_r.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}; expected logits_r's without its last "
                         f"(vocab) dimension, {tuple(logits_r.shape[:-1])}")
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 vocab ids, got {targets.dtype}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing must lie in [0, 1] (0: plain cross-entropy), got {smoothing!r}")
    vocab = logits_r.shape[-1] * dist.get_world_size(group)
    if targets.numel() and not (0 <= int(targets.min()) and int(targets.max()) < vocab):
        raise ValueError(f"targets must lie in [0, {vocab}) (V/t = {logits_r.shape[-1]} per rank times "
                         f"t = {dist.get_world_size(group)} ranks), got [{int(targets.min())}, "
                         f"{int(targets.max())}]")
    v_r = logits_r.shape[-1]
    lo = dist.get_rank(group) * v_r  # the first vocab id of this rank's slice
    z = logits_r.detach().float().reshape(-1, v_r)
    y = targets.reshape(-1)

    m = z.max(dim=-1).values
    comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)
    sum_exp = (z - m[:, None]).exp().sum(dim=-1)
    comm.all_reduce(sum_exp, group=group)
    mine = (y >= lo) & (y < lo + v_r)
    z_y = z.gather(1, (y - lo).clamp(0, v_r - 1)[:, None]).squeeze(1)
    z_y = torch.where(mine, z_y, torch.zeros_like(z_y))  # only the owner of y contributes
    sum_z = z.sum(dim=-1)  # this rank's part of the sum of the row's V logits
    parts = torch.stack([z_y, sum_z])
    comm.all_reduce(parts, group=group)
    z_y, mean_z = parts[0], parts[1] / vocab
    lse = m + sum_exp.log()
    others = (parts[1] - z_y) / (vocab - 1)
    return (lse - (1 - smoothing) * z_y - smoothing * others).mean()
