"""Wrong: returns M_hat = P Qᵀ with the Q passed in, not the new one.

The old Q is at hand and has the right shape; but P Qᵀ is not P Pᵀ M, and with a random start it has
nothing to do with M.
"""
import torch


def powersgd_step(M: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if M.dim() != 2 or Q.dim() != 2:
        raise ValueError(f"M and Q must be matrices, got {M.dim()}-d and {Q.dim()}-d; reshape a "
                         "conv gradient to (out_channels, -1) first")
    if Q.shape[0] != M.shape[1]:
        raise ValueError(f"Q has {Q.shape[0]} rows but M has {M.shape[1]} columns: "
                         "Q must be m x r for M n x m")
    if Q.shape[1] > min(M.shape):
        raise ValueError(f"rank r = {Q.shape[1]} exceeds min(n, m) = {min(M.shape)}")
    P = M @ Q
    P = torch.linalg.qr(P, mode="reduced").Q  # orthonormal columns spanning M Q
    Q_new = M.T @ P
    M_hat = P @ Q.T
    return P, Q_new, M_hat
