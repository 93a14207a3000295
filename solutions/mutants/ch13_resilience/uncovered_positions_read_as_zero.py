"""Wrong: starts from a zero tensor and returns whatever it holds: an uncovered position reads as 0.

Zeros look like a safe default; but a wanted element that no piece holds is a checkpoint that
cannot give this rank its tensor, and a silent 0 trains a model with a hole in it.
"""
import torch


def gather_latest_pieces(pieces, dense_shape, want) -> torch.Tensor:
    dense_shape = tuple(int(s) for s in dense_shape)
    numel = math.prod(dense_shape)
    want = _positions(want, numel, "want")
    checked, dtype = _check_pieces(pieces, numel)
    dense = torch.zeros(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for _, pos, values in sorted(checked, key=lambda piece: piece[0]):
        dense[pos] = values.reshape(-1)
        covered[pos] = True

    return dense[want]
