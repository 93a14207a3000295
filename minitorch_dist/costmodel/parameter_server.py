"""Chapter 02 — parameter servers: bytes and time per step against ring all-reduce; HOGWILD!'s sparsity.

Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server" (OSDI), §3
(push / pull of key ranges); Jiang et al. 2020, "A Unified Architecture for Accelerating
Distributed DNN Training in Heterogeneous GPU/CPU Clusters" (BytePS, OSDI), §4.1, Theorem 1
(the traffic of PS, all-reduce, and the optimum between them); Recht et al. 2011, "HOGWILD!: A
Lock-Free Approach to Parallelizing Stochastic Gradient Descent" (NIPS), §2 (Ω, Δ, ρ).

Notation: Ψ = bytes of the parameters (= bytes of one gradient), n workers, S servers. NICs are
full duplex: a machine sends and receives at the same time, each direction at 1/beta bytes/s,
so a time is set by the busiest *direction* of the busiest NIC. Ring all-reduce is
:func:`.collectives.bus_bytes`: 2(n-1)/n * Ψ sent and as much received by every rank.
"""
from __future__ import annotations

import math

from .collectives import bus_bytes, p2p_time


def _check_ps(num_params, n_workers, n_servers, bytes_per_element):
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if n_workers < 1 or n_servers < 1:
        raise ValueError(f"need >= 1 worker and >= 1 server, got n_workers={n_workers}, "
                         f"n_servers={n_servers}")
    if bytes_per_element <= 0:
        raise ValueError(f"bytes_per_element must be > 0 (4 for fp32), got {bytes_per_element}")


def ps_bytes_per_step(num_params, n_workers, n_servers, bytes_per_element=4) -> dict:
    """Bytes each machine moves in one synchronous step of a parameter server (Li et al. 2014 §3).

    The keys are split evenly over S server machines, separate from the n workers (BytePS calls
    this *non-colocated* PS). Each step every worker pushes its whole gradient (Ψ bytes, Ψ/S to
    each server) and pulls the whole updated model back (Ψ bytes); each server receives its Ψ/S
    slice from all n workers and sends it back to all n::

        worker: sends Ψ, receives Ψ        server: receives n Ψ / S, sends n Ψ / S

    Returned (bytes): ``worker_send``, ``worker_recv``, ``server_recv``, ``server_send``;
    ``bottleneck`` = the most any NIC moves in one direction, ``Ψ * max(1, n/S)``;
    ``allreduce_per_rank`` = what a ring all-reduce of the same gradient sends (and receives)
    per rank, 2(n-1)/n Ψ; ``total`` = every byte on the network, 2nΨ (all-reduce: 2(n-1)Ψ).

    So with S >= n servers a worker's NIC carries Ψ each way, about *half* the ring's
    2(n-1)/n Ψ (BytePS §4.1: non-colocated PS with k = n CPU machines is communication-optimal,
    time Ψβ against the ring's 2(n-1)/n Ψβ), at the price of S extra machines. With fewer
    servers they are the bottleneck: S = 1 receives nΨ, the classic PS hot spot.
    """
    _check_ps(num_params, n_workers, n_servers, bytes_per_element)
    psi = num_params * bytes_per_element
    n, s = n_workers, n_servers
    return {
        "worker_send": float(psi),
        "worker_recv": float(psi),
        "server_recv": n * psi / s,
        "server_send": n * psi / s,
        "bottleneck": psi * max(1.0, n / s),
        "allreduce_per_rank": bus_bytes("all_reduce", psi, n),
        "total": 2.0 * n * psi,
    }


def ps_step_time(num_params, n_workers, n_servers, alpha, beta, bytes_per_element=4,
                 pipelined=False) -> float:
    """Alpha-beta time of one push + pull (Hockney model, :func:`.collectives.p2p_time`).

    Every message carries one server's slice, Ψ/S bytes. In the push a worker sends S of them and
    a server receives n, so the busiest endpoint handles ``max(n, S)`` messages one after another
    (one-port model)::

        t_push = t_pull = max(n, S) * (alpha + (Ψ/S) * beta)

    ``pipelined=False``: pull starts after push ends (a BSP step), ``t = t_push + t_pull``.
    ``pipelined=True``: the gradient is cut into many pieces and the pull of one overlaps the push
    of the next on the full-duplex links, as BytePS assumes in §4.1: ``t = t_push`` in that limit,
    whose bandwidth term ``max(1, n/S) Ψ beta`` is Theorem 1's ``M/B`` for S = n.
    Compare :func:`.collectives.allreduce_time`: ``2(n-1) alpha + 2(n-1)/n Ψ beta``.
    """
    _check_ps(num_params, n_workers, n_servers, bytes_per_element)
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    psi = num_params * bytes_per_element
    one_phase = max(n_workers, n_servers) * p2p_time(psi / n_servers, alpha, beta)
    return one_phase if pipelined else 2 * one_phase


def byteps_optimal_bytes(num_params, n_gpu_machines, k_cpu_machines, bytes_per_element=4) -> dict:
    """BytePS's optimal split of the summation between n GPU and k CPU machines (Jiang et al. 2020
    §4.1, Theorem 1).

    Every machine runs a summation service for a share of the gradient: M_cpu bytes on each CPU
    machine, M_gpu on each GPU machine, ``k M_cpu + n M_gpu = M``. A GPU machine sends the
    M - M_gpu it does not sum itself and serves its M_gpu to the n - 1 others, so it sends
    ``M + (n-2) M_gpu``; a CPU machine sends ``n M_cpu``. Equalising the two (the optimum, for
    k <= n) gives::

        M_cpu = 2(n-1) M / (n² + kn - 2k)      M_gpu = (n-k) M / (n² + kn - 2k)
        bytes per direction on the busiest NIC = 2n(n-1) M / (n² + kn - 2k)

    k = 0 is ring all-reduce's 2(n-1)/n M; k = n is non-colocated PS's M. More than n CPU
    machines do not help: a GPU NIC must still push and pull M (then M_gpu = 0, M_cpu = M/k).
    With n = 1 nothing moves (the one worker sums alone), whatever k.
    Returned (bytes): ``cpu_share``, ``gpu_share``, ``bottleneck``.
    """
    n, k = n_gpu_machines, k_cpu_machines
    if n < 1 or k < 0:
        raise ValueError(f"need n_gpu_machines >= 1 and k_cpu_machines >= 0, got n={n}, k={k}")
    _check_ps(num_params, n, 1, bytes_per_element)
    m = num_params * bytes_per_element
    if n == 1:  # one worker sums its own gradient: nothing crosses the network
        return {"cpu_share": 0.0, "gpu_share": float(m), "bottleneck": 0.0}
    if k >= n:
        return {"cpu_share": m / k, "gpu_share": 0.0, "bottleneck": float(m)}
    d = n * n + k * n - 2 * k
    return {"cpu_share": 2 * (n - 1) * m / d, "gpu_share": (n - k) * m / d,
            "bottleneck": 2 * n * (n - 1) * m / d}


# --- HOGWILD! (Recht et al. 2011 §2) ------------------------------------------------------------


def hogwild_sparsity(supports, n_features) -> dict:
    """Ω, Δ, ρ of a sparse separable cost ``f(x) = Σ_e f_e(x_e)`` (Recht et al. 2011, §2, eq. 2.6).

    Each example e touches only the coordinates in its support (a hyperedge of the hypergraph
    on the n features); with E the list of supports::

        Ω = max_e |e|                                       the largest support
        Δ = max_v |{e in E : v in e}| / |E|                 the busiest coordinate's share
        ρ = max_e |{e' in E : e' ∩ e ≠ ∅}| / |E|            the most conflicting example's share

    (an example with a non-empty support meets itself, so ρ >= 1/|E|). HOGWILD!'s rate degrades
    gracefully while ρ and Δ are small: few concurrent updates touch the same coordinates.
    Also returned: ``collision``, the probability that two examples drawn independently and
    uniformly (with replacement) from E share a coordinate — the mean of which ρ is the max.
    """
    supports = [frozenset(int(v) for v in e) for e in supports]
    if not supports:
        raise ValueError("hogwild_sparsity needs at least one example support")
    if n_features < 1:
        raise ValueError(f"n_features must be >= 1, got {n_features}")
    for i, e in enumerate(supports):
        if e and (min(e) < 0 or max(e) >= n_features):
            raise ValueError(f"support {i} has coordinates outside 0..{n_features - 1}: {sorted(e)}")
    m = len(supports)
    degree = [0] * n_features
    for e in supports:
        for v in e:
            degree[v] += 1
    # examples meeting e = examples containing any v in e, counted once each
    meets = [sum(1 for f in supports if not e.isdisjoint(f)) for e in supports]
    return {
        "omega": max(len(e) for e in supports),
        "delta": max(degree) / m,
        "rho": max(meets) / m,
        "collision": sum(meets) / (m * m),
    }


def hogwild_conflict_probability(support_size, n_features, n_concurrent=2) -> float:
    """Probability that an update conflicts with at least one of ``n_concurrent - 1`` others in
    flight, when every support is ``support_size`` coordinates drawn uniformly without replacement
    (a model of Recht et al.'s sparse problems, §2; a back-of-envelope for when lock-free SGD works).

    Two random supports of size ω out of d are disjoint with probability ``C(d-ω, ω) / C(d, ω)``,
    and independent draws are independent, so::

        P(conflict) = 1 - (C(d-ω, ω) / C(d, ω)) ** (p - 1)

    For ω² << d this is about ``(p-1) ω² / d``; a dense problem (ω = d) always conflicts.
    """
    w, d, p = support_size, n_features, n_concurrent
    if d < 1 or not 0 <= w <= d:
        raise ValueError(f"need 0 <= support_size <= n_features and n_features >= 1, got {w} of {d}")
    if p < 1:
        raise ValueError(f"n_concurrent must be >= 1, got {p}")
    disjoint = math.comb(d - w, w) / math.comb(d, w)
    return 1.0 - disjoint ** (p - 1)
