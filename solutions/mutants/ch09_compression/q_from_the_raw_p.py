"""Wrong: computes Q_new = Mᵀ (M Q) from P before orthogonalising it, then orthogonalises P.

The order of the paper's lines looks interchangeable; it is not: Q_new must be Mᵀ P for the
orthonormal P, or P Q_newᵀ is not the projection of M.
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
    Q_new = M.T @ P
    P = torch.linalg.qr(P, mode="reduced").Q
    M_hat = P @ Q_new.T
    return P, Q_new, M_hat
