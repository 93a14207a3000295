"""Wrong: stacks at ``dim + 1`` without first making ``dim`` non-negative.

Right for dims 0 and 1; for dim = -1 the stack lands at dimension 0 and the flatten joins the wrong
pair of dimensions.
"""
import torch


def striped_reassemble(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    if not shards:
        raise ValueError("striped_reassemble needs the t shards, got none")
    return torch.stack(shards, dim=dim + 1).flatten(dim, dim + 1)
