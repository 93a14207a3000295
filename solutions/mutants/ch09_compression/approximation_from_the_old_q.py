"""Wrong: returns M_hat = P Qᵀ with the Q the last round started from, not the new one.

The old Q is at hand and has the right shape; but P Qᵀ is not P Pᵀ M, and from a random start it has
nothing to do with M's size: a rank-r matrix is not reproduced.
"""
import torch


def powersgd_step(M: torch.Tensor, Q: torch.Tensor, iters: int = 1,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if M.dim() != 3 or Q.dim() != 3:
        raise ValueError(f"M and Q must be stacks of matrices, (b, n, m) and (b, m, r); got {M.dim()}-d and "
                         f"{Q.dim()}-d (one matrix is M.unsqueeze(0))")
    if Q.shape[0] != M.shape[0]:
        raise ValueError(f"Q stacks {Q.shape[0]} matrices but M stacks {M.shape[0]}: one Q per matrix")
    if Q.shape[1] != M.shape[2]:
        raise ValueError(f"Q has {Q.shape[1]} rows but M has {M.shape[2]} columns: "
                         "Q must be m x r for M n x m")
    if not 1 <= Q.shape[2] <= min(M.shape[1:]):
        raise ValueError(f"rank r = {Q.shape[2]} must be in [1, min(n, m) = {min(M.shape[1:])}]")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1 (rounds of power iteration), got {iters!r}")
    if not M.is_floating_point() or Q.dtype != M.dtype:
        raise TypeError(f"M and Q must share one floating dtype, got {M.dtype} and {Q.dtype}")
    for _ in range(iters):
        Q_prev = Q
        P = M @ Q
        R, info = torch.linalg.cholesky_ex(P.mT @ P, upper=True)  # PᵀP = RᵀR, R's diagonal > 0
        if bool((info != 0).any()):
            bad = torch.nonzero(info).flatten().tolist()
            raise ValueError(f"PᵀP is not positive definite for matrices {bad} of the stack: M Q is "
                             "rank-deficient there, and Cholesky QR cannot orthogonalise it")
        P = torch.linalg.solve_triangular(R, P, upper=True, left=False)  # P R⁻¹
        Q = M.mT @ P
    return P, Q, P @ Q_prev.mT
