"""Chapter 02's formulas, each derived again here: parameter-server bytes and alpha-beta time from
a message-by-message traffic table (Li et al. 2014 §3), ring all-reduce from a simulated ring,
BytePS's optimal split (Jiang et al. 2020 §4.1, Theorem 1) against a search over every split, and
HOGWILD!'s Ω, Δ, ρ (Recht et al. 2011 §2) and conflict probability by brute force over small
supports. The measured side is in test_parameter_server.py and test_hogwild.py.

Tolerances: traffic tables are integers and the search uses exact fractions; float results are a few
float64 operations (rel 1e-12, or 1e-6 where a share is turned into a fraction with denominators up
to 1e6); the BytePS optimum must come within the search grid's resolution (1e-3). HOGWILD!'s conflict
probability against its sparse approximation (p - 1)ω²/d: the next term is O((pω²/d)²), 1e-3 relative
for ω = 3, d = 1e5, p = 4."""
import itertools
import math
from fractions import Fraction

import pytest

from minitorch_dist import costmodel as cm

pytestmark = pytest.mark.ch02


# --- an independent traffic table --------------------------------------------------------------------

def _ps_messages(psi, n, s):
    """Push then pull of a PS with n workers and s separate servers: lists of (src, dst, bytes).
    Key ranges are cut evenly; exact fractions so that sums compare exactly."""
    slice_ = Fraction(psi, s)
    push = [(("w", w), ("s", j), slice_) for w in range(n) for j in range(s)]
    pull = [(("s", j), ("w", w), slice_) for w in range(n) for j in range(s)]
    return push, pull


def _per_machine(messages):
    sent, recv, count_out, count_in = {}, {}, {}, {}
    for src, dst, b in messages:
        sent[src] = sent.get(src, 0) + b
        recv[dst] = recv.get(dst, 0) + b
        count_out[src] = count_out.get(src, 0) + 1
        count_in[dst] = count_in.get(dst, 0) + 1
    return sent, recv, count_out, count_in


def _ring_allreduce_sent(psi, n):
    """Bytes each rank sends in a simulated ring all-reduce: n-1 reduce-scatter and n-1 all-gather
    steps, each passing one chunk of psi/n to the right neighbour."""
    sent = [Fraction(0)] * n
    for _ in range(2 * (n - 1)):
        for r in range(n):
            sent[r] += Fraction(psi, n)
    return sent


@pytest.mark.parametrize("params, n, s",
                         [(1000, 1, 1), (1000, 4, 1), (1200, 4, 2), (1200, 4, 4), (1200, 3, 6),
                          (10 ** 6, 8, 8), (999, 5, 3)])
def test_ps_bytes_per_step_matches_traffic_table(params, n, s):
    got = cm.ps_bytes_per_step(params, n, s, bytes_per_element=2)
    psi = 2 * params
    push, pull = _ps_messages(psi, n, s)
    sent, recv, _, _ = _per_machine(push + pull)
    assert got["worker_send"] == pytest.approx(float(sent[("w", 0)]))
    assert got["worker_recv"] == pytest.approx(float(recv[("w", 0)]))
    assert got["server_recv"] == pytest.approx(float(recv[("s", 0)]))
    assert got["server_send"] == pytest.approx(float(sent[("s", 0)]))
    every = list(sent.values()) + list(recv.values())
    assert got["bottleneck"] == pytest.approx(float(max(every)))
    assert got["total"] == pytest.approx(float(sum(sent.values())))
    ring = _ring_allreduce_sent(psi, n)
    assert got["allreduce_per_rank"] == pytest.approx(float(max(ring)))


def test_ps_bytes_per_step_half_the_ring_with_n_servers():
    # S = n separate servers: each worker NIC moves psi per direction, the ring 2(n-1)/n psi
    for n in (2, 4, 16, 64):
        b = cm.ps_bytes_per_step(10 ** 6, n, n)
        assert b["bottleneck"] == 4 * 10 ** 6
        assert b["allreduce_per_rank"] == pytest.approx(2 * (n - 1) / n * 4 * 10 ** 6)
        assert b["bottleneck"] <= b["allreduce_per_rank"]  # equal at n = 2
    # one server: the hot spot receives n psi
    assert cm.ps_bytes_per_step(10, 8, 1, bytes_per_element=1)["bottleneck"] == 80


def test_ps_bytes_per_step_rejects_bad_input():
    with pytest.raises(ValueError, match="server"):
        cm.ps_bytes_per_step(10, 4, 0)
    with pytest.raises(ValueError, match="bytes_per_element"):
        cm.ps_bytes_per_step(10, 4, 2, bytes_per_element=0)


@pytest.mark.parametrize("n, s", [(1, 1), (4, 1), (4, 2), (4, 4), (2, 8), (6, 3)])
@pytest.mark.parametrize("pipelined", [False, True])
def test_ps_step_time_one_port_endpoints(n, s, pipelined):
    alpha, beta, params = 3e-6, 1 / 10e9, 12345
    push, pull = _ps_messages(4 * params, n, s)
    phases = []
    for msgs in (push, pull):
        sent, recv, c_out, c_in = _per_machine(msgs)
        # each endpoint handles its messages one after another; the busiest sets the phase
        per = [c_out[m] * alpha + float(sent[m]) * beta for m in sent] + \
              [c_in[m] * alpha + float(recv[m]) * beta for m in recv]
        phases.append(max(per))
    expected = max(phases) if pipelined else sum(phases)
    assert (cm.ps_step_time(params, n, s, alpha, beta, pipelined=pipelined)
            == pytest.approx(expected, rel=1e-12))


def test_ps_step_time_pipelined_bandwidth_term_vs_ring():
    beta, psi = 1 / 12.5e9, 4 * 10 ** 8
    for n in (4, 8, 32):
        ps = cm.ps_step_time(10 ** 8, n, n, 0.0, beta, pipelined=True)
        ring = cm.allreduce_time(psi, n, 0.0, beta)
        assert ps == pytest.approx(psi * beta)
        assert ring / ps == pytest.approx(2 * (n - 1) / n)
    with pytest.raises(ValueError, match="alpha and beta"):
        cm.ps_step_time(10, 2, 2, -1.0, 1e-9)


# --- BytePS Theorem 1 ------------------------------------------------------------------------------

def _byteps_bottleneck(m, n, k, gpu_share):
    """Busiest NIC direction when each GPU machine sums gpu_share and each CPU machine the rest / k.
    Built message by message: worker i sends the parts it does not sum to their owners, every
    owner returns its summed part to every other worker."""
    cpu_share = (m - n * gpu_share) / k if k else Fraction(0)
    owners = [("g", j, gpu_share) for j in range(n)] + [("c", j, cpu_share) for j in range(k)]
    sent, recv = {}, {}

    def move(a, b, nbytes):
        if a != b and nbytes:
            sent[a] = sent.get(a, 0) + nbytes
            recv[b] = recv.get(b, 0) + nbytes

    for i in range(n):
        for kind, j, share in owners:
            move(("g", i), (kind, j), share)  # push
            move((kind, j), ("g", i), share)  # pull
    return max(list(sent.values()) + list(recv.values()) + [0])


@pytest.mark.parametrize("n, k",
                         [(2, 0), (4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (3, 1), (8, 5), (2, 4), (1, 2)])
def test_byteps_optimal_bytes_is_the_best_split(n, k):
    m = 3600
    got = cm.byteps_optimal_bytes(m, n, k, bytes_per_element=1)
    # search every split on a fine grid of the GPU share, exact arithmetic
    grid = [Fraction(m, n) * Fraction(i, 720) for i in range(721)] if k else [Fraction(m, n)]
    best = min(_byteps_bottleneck(m, n, k, g) for g in grid)
    assert got["bottleneck"] <= float(best) * (1 + 1e-12), \
        f"a split on the grid moves only {float(best)} bytes"
    assert got["bottleneck"] >= float(best) * (1 - 1e-3), "the grid should come within its resolution"
    # and the returned shares achieve it and add up to the model
    assert k * got["cpu_share"] + n * got["gpu_share"] == pytest.approx(m)
    achieved = _byteps_bottleneck(m, n, k, Fraction(got["gpu_share"]).limit_denominator(10 ** 6))
    assert float(achieved) == pytest.approx(got["bottleneck"], rel=1e-6)


def test_byteps_optimal_bytes_unifies_allreduce_and_ps():
    for n in (2, 4, 16):
        assert (cm.byteps_optimal_bytes(10 ** 6, n, 0)["bottleneck"]
                == pytest.approx(cm.bus_bytes("all_reduce", 4e6, n)))
        assert cm.byteps_optimal_bytes(10 ** 6, n, n)["bottleneck"] == pytest.approx(4e6)
        assert (cm.byteps_optimal_bytes(10 ** 6, n, n)["bottleneck"]
                == cm.ps_bytes_per_step(10 ** 6, n, n)["bottleneck"])
        # more CPU machines only help, up to k = n
        seq = [cm.byteps_optimal_bytes(10 ** 6, n, k)["bottleneck"] for k in range(2 * n + 1)]
        assert all(a >= b for a, b in zip(seq, seq[1:])) and seq[n] == seq[-1]


# --- HOGWILD! ----------------------------------------------------------------------------------------

def _brute_sparsity(supports, d):
    m = len(supports)
    omega = max(len(e) for e in supports)
    delta = max(sum(1 for e in supports if v in e) for v in range(d)) / m

    def meet(a, b):
        return any(x == y for x in a for y in b)

    rho = max(sum(1 for f in supports if meet(e, f)) for e in supports) / m
    collision = sum(1 for e in supports for f in supports if meet(e, f)) / m ** 2
    return omega, delta, rho, collision


CASES = [
    ([[0], [1], [2], [3]], 4),  # perfectly separable
    ([[0, 1, 2, 3]] * 3, 4),  # dense
    ([[0, 1], [1, 2], [2, 3], [3, 0], [4]], 5),
    ([[0, 5], [5], [1, 2, 3], [], [7, 8, 9]], 10),  # an empty support meets nothing
]


@pytest.mark.parametrize("supports, d", CASES)
def test_hogwild_sparsity_brute_force(supports, d):
    got = cm.hogwild_sparsity(supports, d)
    omega, delta, rho, collision = _brute_sparsity(supports, d)
    assert got["omega"] == omega
    assert got["delta"] == pytest.approx(delta)
    assert got["rho"] == pytest.approx(rho)
    assert got["collision"] == pytest.approx(collision)
    assert got["collision"] <= got["rho"] + 1e-12


def test_hogwild_sparsity_random_supports():
    import random

    rng = random.Random(0)
    for _ in range(5):
        d = rng.randint(5, 30)
        supports = [rng.sample(range(d), rng.randint(1, 4)) for _ in range(rng.randint(3, 25))]
        got = cm.hogwild_sparsity(supports, d)
        assert ((got["omega"], got["delta"], got["rho"], got["collision"])
                == pytest.approx(_brute_sparsity(supports, d)))


def test_hogwild_sparsity_extremes_and_errors():
    sep = cm.hogwild_sparsity([[i] for i in range(10)], 10)
    assert sep["delta"] == sep["rho"] == sep["collision"] == pytest.approx(0.1)
    dense = cm.hogwild_sparsity([range(10)] * 4, 10)
    assert dense["delta"] == dense["rho"] == dense["collision"] == 1.0 and dense["omega"] == 10
    with pytest.raises(ValueError, match="outside"):
        cm.hogwild_sparsity([[0, 10]], 10)
    with pytest.raises(ValueError, match="at least one"):
        cm.hogwild_sparsity([], 10)


@pytest.mark.parametrize("w, d", [(1, 5), (2, 6), (3, 7), (2, 4), (0, 3), (4, 4)])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_hogwild_conflict_probability_enumerated(w, d, p):
    subsets = [set(c) for c in itertools.combinations(range(d), w)]
    hits = total = 0
    for first in subsets:  # every assignment of supports to the p concurrent updates
        for others in itertools.product(subsets, repeat=p - 1):
            total += 1
            hits += any(first & o for o in others)
    assert cm.hogwild_conflict_probability(w, d, p) == pytest.approx(hits / total)


def test_hogwild_conflict_probability_sparse_approximation():
    # omega^2 << d: about (p-1) omega^2 / d
    p, w, d = 4, 3, 10 ** 5
    assert cm.hogwild_conflict_probability(w, d, p) == pytest.approx((p - 1) * w * w / d, rel=1e-3)
    with pytest.raises(ValueError, match="support_size"):
        cm.hogwild_conflict_probability(5, 4)
    assert math.isclose(cm.hogwild_conflict_probability(4, 4, 2), 1.0)
