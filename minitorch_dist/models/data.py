"""Chapter 00 — a synthetic corpus whose best possible loss is known: a random first-order Markov chain.

For a stationary Markov chain with transition matrix P and stationary distribution π, the
entropy rate is (Cover & Thomas, *Elements of Information Theory*, 2nd ed., Thm 4.2.4)

    H(X) = -Σ_i π_i Σ_j P_ij log P_ij  =  Σ_i π_i H(P_i·)        [nats / token]

No model can have a lower expected next-token cross-entropy on this data, so a notebook can
plot training loss against a floor that is known exactly, not guessed. Each state i may move
to ``successors`` states, with probabilities drawn from a symmetric Dirichlet(``concentration``):
the floor then sits well below log(V), and a tiny GPT learns the V×V table in seconds.

Batches are a pure function of (seed, step): rank r of n takes rows [r·B/n, (r+1)·B/n) of the
*global* batch of that step, so n data-parallel ranks see exactly the batch one process sees.
"""
from __future__ import annotations

import math

import numpy as np
import torch


class MarkovCorpus:
    """Random first-order Markov chain over ``vocab_size`` tokens.

    Attributes: ``transition`` (V, V) float64, rows sum to 1; ``stationary`` (V,) float64 with
    π P = π; ``entropy_rate`` float, nats/token.
    """

    def __init__(self, vocab_size: int = 64, seed: int = 0, successors: int = 8, concentration: float = 1.0):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not isinstance(successors, int) or not 1 <= successors <= vocab_size:
            raise ValueError(f"successors must be an int in [1, vocab_size={vocab_size}], got {successors!r}")
        if not concentration > 0:
            raise ValueError(f"concentration must be > 0 (Dirichlet parameter), got {concentration!r}")
        self.vocab_size, self.seed = vocab_size, int(seed)
        self.successors, self.concentration = successors, float(concentration)

        V, k = vocab_size, successors
        g = torch.Generator().manual_seed(self._mix(self.seed, -1))
        # Successor sets: i -> i+1 (mod V) always, so the states form one cycle and the chain is
        # irreducible (a unique π); the other k-1 successors are random distinct states.
        succ = torch.empty(V, k, dtype=torch.long)
        for i in range(V):
            succ[i, 0] = (i + 1) % V
            # i + 2 + j (mod V) for j in 0..V-2 runs over every state except i + 1
            succ[i, 1:] = (i + 2 + torch.randperm(V - 1, generator=g)[: k - 1]) % V
        # Dirichlet(α) = normalised Gamma(α, 1) draws.
        gam = torch._standard_gamma(torch.full((V, k), self.concentration, dtype=torch.float64), generator=g)
        gam = gam.clamp_min(1e-300)  # tiny α can underflow to 0; keep every listed edge alive
        P = torch.zeros(V, V, dtype=torch.float64)
        P.scatter_(1, succ, gam / gam.sum(1, keepdim=True))
        self.transition = P
        self.stationary = self._stationary(P)
        plogp = torch.where(P > 0, P * P.log(), torch.zeros_like(P))
        self.entropy_rate = float(-(self.stationary * plogp.sum(1)).sum())
        # Inverse-CDF tables for sampling. Dividing by the last entry makes it exactly 1.0, so a
        # uniform u in [0, 1) can never land past the end or on a zero-probability state.
        cdf = P.cumsum(1)
        self._cdf = cdf / cdf[:, -1:]
        pi_cdf = self.stationary.cumsum(0)
        self._pi_cdf = pi_cdf / pi_cdf[-1]

    @staticmethod
    def _mix(seed: int, step: int) -> int:
        """A well-mixed 63-bit generator seed from (seed, step): nearby steps get unrelated streams."""
        state = np.random.SeedSequence([seed & (2**63 - 1), step + 1]).generate_state(1, np.uint64)
        return int(state[0] >> 1)

    @staticmethod
    def _stationary(P: torch.Tensor) -> torch.Tensor:
        """Solve π (P - I) = 0 with Σ π = 1 exactly (works for periodic chains too, unlike power
        iteration)."""
        V = P.shape[0]
        A = (P - torch.eye(V, dtype=P.dtype)).T.clone()
        A[-1] = 1.0  # replace one (redundant) balance equation by the normalisation
        b = torch.zeros(V, dtype=P.dtype)
        b[-1] = 1.0
        return torch.linalg.solve(A, b).clamp_min(0.0)

    def _walk(self, u: torch.Tensor) -> torch.Tensor:
        """Turn uniforms u (rows, L) into chains of length L: x_0 ~ π, x_{t+1} ~ P[x_t]."""
        x = torch.empty(u.shape, dtype=torch.long)
        x[:, 0] = torch.searchsorted(self._pi_cdf, u[:, 0].contiguous(), right=True)
        for t in range(1, u.shape[1]):
            rows = self._cdf[x[:, t - 1]]  # (rows, V): CDF of each row's current state
            x[:, t] = torch.searchsorted(rows, u[:, t : t + 1].contiguous(), right=True).squeeze(1)
        return x

    def batch(self, step: int, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1,
              device=None):
        """Rows [rank·B/n, (rank+1)·B/n) of the global batch number ``step``: ``(x, y)``, int64.

        Each of the B global rows is a chain of seq_len + 1 tokens started from π (so the chain is
        stationary and every position's conditional entropy is the entropy rate); x is the first
        seq_len tokens, y the last seq_len (x shifted by one). Depends only on (seed, step): all
        uniforms of the global batch are drawn, then this rank keeps and walks only its rows.
        """
        for name, v in (("step", step), ("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "step" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'step' else 'positive'} int, "
                                 f"got {v!r}")
        if not (isinstance(world_size, int) and world_size >= 1
                and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if batch_size % world_size:
            raise ValueError(
                f"batch_size {batch_size} is not divisible by world_size {world_size}; use a global "
                "batch_size that is a multiple of world_size (e.g. "
                f"{math.ceil(batch_size / world_size) * world_size})"
            )
        g = torch.Generator().manual_seed(self._mix(self.seed, step))
        u = torch.rand(batch_size, seq_len + 1, dtype=torch.float64, generator=g)
        per = batch_size // world_size
        tokens = self._walk(u[rank * per : (rank + 1) * per])
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if device is not None:
            x, y = x.to(device), y.to(device)
        return x, y

    def sample(self, n_tokens: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """One chain of ``n_tokens`` tokens (1-D int64) started from π."""
        u = torch.rand(1, n_tokens, dtype=torch.float64, generator=generator)
        return self._walk(u)[0]

    def nll(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The true chain's mean -log P(y_t | x_t) on a batch: the loss a perfect model gets there."""
        P = self.transition.to(x.device)
        return float(-P[x.reshape(-1), y.reshape(-1)].log().mean())

    def __repr__(self) -> str:
        return (
            f"MarkovCorpus(vocab_size={self.vocab_size}, seed={self.seed}, successors={self.successors}, "
            f"concentration={self.concentration}) entropy_rate={self.entropy_rate:.4f} nats "
            f"(log V = {math.log(self.vocab_size):.4f})"
        )
