"""Wrong: sorts the pieces newest first before scattering, so the oldest lands last and wins.

"Newest first" is the natural priority order to write down; but with a scatter the last write
wins, so the priority must be applied oldest first.
"""
import torch


def gather_latest_pieces(pieces, dense_shape, want) -> torch.Tensor:
    dense_shape = tuple(int(s) for s in dense_shape)
    numel = math.prod(dense_shape)
    want = _positions(want, numel, "want")
    checked, dtype = _check_pieces(pieces, numel)
    dense = torch.empty(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for _, pos, values in sorted(checked, key=lambda piece: -piece[0]):
        dense[pos] = values.reshape(-1)
        covered[pos] = True
    missing = int((~covered[want]).sum())
    if missing:
        raise ValueError(f"{missing} wanted elements are in no saved piece (of the {want.numel()} this "
                         f"rank asks for): the checkpoint is incomplete")
    return dense[want]
