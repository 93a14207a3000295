"""Wrong: scatters the pieces in the order they are listed, so the last listed wins, not the newest.

For one save the order does not matter (overlapping pieces are replicas), and a list written in
save order puts the newest last anyway; but nothing promises that order, and an older partial save
listed after a newer one overwrites it.
"""
import torch


def gather_latest_pieces(pieces, dense_shape, want) -> torch.Tensor:
    dense_shape = tuple(int(s) for s in dense_shape)
    numel = math.prod(dense_shape)
    want = _positions(want, numel, "want")
    checked, dtype = _check_pieces(pieces, numel)
    dense = torch.empty(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for _, pos, values in checked:
        dense[pos] = values.reshape(-1)
        covered[pos] = True
    missing = int((~covered[want]).sum())
    if missing:
        raise ValueError(f"{missing} wanted elements are in no saved piece (of the {want.numel()} this "
                         f"rank asks for): the checkpoint is incomplete")
    return dense[want]
