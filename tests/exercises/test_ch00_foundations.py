"""Chapter 00 exercises, autograded: a log-step all-gather for any n (Bruck), alpha-beta fit, memory math,
bytes on the wire predicted and counted.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: PyTorch's own ``all_gather_into_tensor``, the
comm meter, and the formulas of ``minitorch_dist.costmodel``.

Tolerances (see tests/_support.py). Gathers, bytes and counts are compared exactly. The alpha-beta
fit is a least-squares solve of m rows and 2 unknowns in float64: a backward-stable solve (QR, SVD)
lands within c·m·2·u·κ of the exact solution, the normal equations within c·m·2·u·κ², κ the
condition number of the design matrix with unit columns (about 1.3 here), c a small constant (16);
read per coefficient, times |y|/|y_j| of the scaled solution (:func:`_fit_bound`, ~1e-13 relative).
On exact times that recovers alpha and beta; on noisy times it equals costmodel's fit, same
objective, to that bound plus κ²·u·|r| of the residual. Against the truth a fit of times with 2 %
Gaussian noise is judged in standard errors of the weighted least-squares estimate,
``0.02·sqrt(diag((AᵀA)⁻¹))``, computed from the design (:func:`_standard_errors`): within 5 (false
alarm ~1e-6 for the two); an unweighted fit misses alpha by ~30 of them. The memory formulas are each
a few float64 products: pytest.approx's default rel 1e-6 is far above their k·u (~1e-15) and far below a
byte per parameter (>= 1/16 of the total).
"""
import random
import sys

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist

from minitorch_dist import comm, costmodel

from _support import gamma, run_cases

pytestmark = pytest.mark.ch00

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this
# file (whatever pytest's import mode). The exercise module is registered by value by `load`.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 1. bruck_all_gather -------------------------------------------------------------------------

# (shape, dtype) of each case: 1-D and 2-D chunks; int64 and bfloat16 catch a gather that goes
# through float arithmetic (a sum with zeros, a mean) instead of moving bytes
GATHER_CASES = {"f32_2d": ((3, 5), torch.float32), "i64_1d": ((7,), torch.int64),
                "bf16_2d": ((2, 3), torch.bfloat16)}


def _gather_one(impl, shape, dtype):
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + r)
    chunk = (torch.randn(shape, generator=g) * 1000).to(dtype)
    expected = chunk.new_empty((n * shape[0], *shape[1:]))
    dist.all_gather_into_tensor(expected, chunk)  # PyTorch's own, outside the meter
    before = chunk.clone()
    with comm.meter() as m:
        got = impl(chunk)
    sends = [e.nbytes for e in m.events if e.op == "send"]
    return (got, expected, dict(m.calls), sends, chunk.numel() * chunk.element_size(),
            torch.equal(chunk, before))


def _gather_on_ranks(impl):
    return run_cases({name: (lambda s=s, d=d: _gather_one(impl, s, d))
                      for name, (s, d) in GATHER_CASES.items()})


# A deadlocked exchange (both partners blocking in send) fails after this long, naming each
# rank's last op, instead of launch's default 300 s.
TIMEOUT_S = 60

GATHER_RANKS = [2, 3, 4, 5, 6]  # powers of two and not: 3, 5 and 6 have no partner r ^ 2**k


@pytest.fixture(scope="module")
def gathered(ex, launches):
    return launches(_gather_on_ranks, ex.bruck_all_gather, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case_name", list(GATHER_CASES))
@pytest.mark.parametrize("n", GATHER_RANKS)
def test_bruck_all_gather_matches_all_gather_into_tensor(gathered, n, case_name):
    shape, dtype = GATHER_CASES[case_name]
    for r, (got, expected, *_, untouched) in enumerate(gathered.case(n, case_name)):
        assert isinstance(got, torch.Tensor), f"rank {r} returned {type(got).__name__}, not a tensor"
        assert got.dtype == dtype, f"rank {r}: dtype {got.dtype}, expected {dtype}"
        assert got.shape == expected.shape == (n * shape[0], *shape[1:]), \
            f"rank {r}: shape {tuple(got.shape)}"
        assert torch.equal(got, expected), \
            f"rank {r} of {n}: blocks out of place (rank i's chunk belongs at rows i*{shape[0]}..)"
        assert untouched, f"rank {r}: the input chunk was changed"


@pytest.mark.parametrize("n", GATHER_RANKS)
def test_bruck_all_gather_sends_ceil_log2n_messages_and_each_block_once(gathered, n):
    steps = (n - 1).bit_length()  # ceil(log2 n)
    for r, (got, expected, calls, sends, block, _) in enumerate(gathered.case(n, "i64_1d")):
        assert torch.equal(got, expected), f"rank {r}: wrong result"
        assert set(calls) <= {"send", "recv"}, \
            f"rank {r} ran {dict(calls)}: build it from point-to-point sends and receives only"
        assert calls.get("send") == steps and calls.get("recv") == steps, \
            f"rank {r}: {calls.get('send', 0)} sends / {calls.get('recv', 0)} receives through comm, " \
            f"expected ceil(log2 {n}) = {steps} of each"
        S = n * block  # the gathered tensor
        assert sum(sends) == (n - 1) * block == costmodel.bus_bytes("all_gather", S, n), \
            f"rank {r} sent {sum(sends)} B in messages {sends}; the lower bound is (n-1) blocks = " \
            f"{(n - 1) * block} B: never send a block the receiver already holds"
        # round k doubles what a rank holds, except the last, which sends only what is missing
        held, want = 1, []
        while held < n:
            want.append(min(held, n - held) * block)
            held += want[-1] // block
        assert sends == want, f"rank {r}: message sizes {sends}, expected {want}"


# --- 2. alpha_beta_from_timings----------------------------------------------------------------------

SIZES = 2.0 ** np.arange(10, 27)  # 1 KiB .. 64 MiB, the range of an nccl-tests sweep


NOISE = 0.02  # the multiplicative noise of the noisy sweep


def _design(sizes, times, n):
    """The fit's rows: the ring all-reduce's [2(n-1), 2(n-1)/n·S] over t (relative error)."""
    sizes, times = np.asarray(sizes, dtype=np.float64), np.asarray(times, dtype=np.float64)
    return np.stack([np.full_like(sizes, 2 * (n - 1)), 2 * (n - 1) / n * sizes], axis=1) / times[:, None]


def _fit_bound(sizes, times, n, coef, residual=0.0):
    """Per coefficient, the relative rounding error of a least-squares solve (module docstring)."""
    A = _design(sizes, times, n)
    norms = np.linalg.norm(A, axis=0)
    kappa = np.linalg.cond(A / norms)
    y = np.abs(np.asarray(coef)) * norms  # the solution of the unit-column problem
    m, k = A.shape
    rel = gamma(16 * m * k, torch.float64) * kappa ** 2 * (1 + residual)
    return rel * np.linalg.norm(y) / y


def _standard_errors(sizes, times, n):
    """Standard errors of the weighted fit's (alpha, beta) under NOISE relative Gaussian noise."""
    A = _design(sizes, times, n)
    return NOISE * np.sqrt(np.diag(np.linalg.inv(A.T @ A)))


@pytest.mark.parametrize("alpha,beta", [(20e-6, 1 / 5e9), (3e-6, 1 / 150e9), (1e-3, 1 / 1e8)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_alpha_beta_from_timings_recovers_exact_parameters(ex, n, alpha, beta):
    times = [costmodel.allreduce_time(S, n, alpha, beta) for S in SIZES]
    got = ex.alpha_beta_from_timings(SIZES, times, n)
    assert len(got) == 2 and all(isinstance(v, float) for v in got), f"return two floats, got {got!r}"
    rel = _fit_bound(SIZES, times, n, (alpha, beta))
    assert got[0] == pytest.approx(alpha, rel=rel[0], abs=0), "alpha"
    assert got[1] == pytest.approx(beta, rel=rel[1], abs=0), "beta"


def test_alpha_beta_from_timings_random_links_and_ranks(ex):
    rng = np.random.default_rng(2005)
    for _ in range(30):
        n = int(rng.integers(2, 17))  # any n, not only powers of two
        alpha = float(10 ** rng.uniform(-7, -3))
        beta = float(1 / 10 ** rng.uniform(8, 12))
        sizes = np.sort(2.0 ** rng.uniform(8, 28, size=int(rng.integers(3, 20))))
        times = [costmodel.allreduce_time(S, n, alpha, beta) for S in sizes]
        got = ex.alpha_beta_from_timings(sizes, times, n)
        rel = _fit_bound(sizes, times, n, (alpha, beta))
        assert got[0] == pytest.approx(alpha, rel=rel[0], abs=0), f"alpha, n={n}"
        assert got[1] == pytest.approx(beta, rel=rel[1], abs=0), f"beta, n={n}"


def test_alpha_beta_from_timings_with_noise_matches_costmodel(ex):
    n, alpha, beta = 4, 20e-6, 1 / 5e9
    rng = np.random.default_rng(0)
    sizes = np.repeat(SIZES, 5)  # 5 repeats per size, 2% multiplicative noise on each
    clean = np.array([costmodel.allreduce_time(S, n, alpha, beta) for S in sizes])
    times = clean * (1 + NOISE * rng.standard_normal(sizes.size))
    got_alpha, got_beta = ex.alpha_beta_from_timings(sizes, times, n)
    ref_alpha, ref_beta = costmodel.fit_alpha_beta(sizes, times, n)  # same model, same objective
    residual = float(np.linalg.norm(_design(sizes, times, n) @ [ref_alpha, ref_beta] - 1))
    rel = _fit_bound(sizes, times, n, (ref_alpha, ref_beta), residual)
    assert got_alpha == pytest.approx(ref_alpha, rel=2 * rel[0], abs=0)
    assert got_beta == pytest.approx(ref_beta, rel=2 * rel[1], abs=0)
    # and close to the truth: alpha too, which an unweighted fit loses under the large sizes' noise
    se = _standard_errors(sizes, clean, n)
    for name, got, true, s in (("alpha", got_alpha, alpha, se[0]), ("beta", got_beta, beta, se[1])):
        assert abs(got - true) <= 5 * s, f"{name} {got:.4g}: {abs(got - true) / s:.1f} standard errors off"


# --- 3. training_memory_bytes ----------------------------------------------------------------

KEYS = ("weights", "gradients", "optimizer", "total")


def test_training_memory_bytes_mixed_adamw_is_16_bytes_per_param(ex):
    for N in (1, 1000, 124_439_808, 7_500_000_000):
        got = ex.training_memory_bytes(N)
        assert {k: got[k] for k in KEYS} == {"weights": 2 * N, "gradients": 2 * N,
                                             "optimizer": 12 * N, "total": 16 * N}, f"N={N}"


def test_training_memory_bytes_gpt2_1_5b_needs_24_gb(ex):
    # ZeRO §3.1: 1.5B parameters, mixed-precision Adam -> at least 24 GB of model states
    assert ex.training_memory_bytes(1.5e9, "adam", "mixed")["total"] == pytest.approx(24 * costmodel.GB)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "sgd_nomomentum"])
def test_training_memory_bytes_matches_costmodel(ex, optimizer, precision):
    rng = random.Random(f"{optimizer}-{precision}")
    for N in (1, 3, 1_000_003, 1.5e9, *(rng.randrange(1, 10**13) for _ in range(20))):
        got = ex.training_memory_bytes(N, optimizer=optimizer, precision=precision)
        ref = costmodel.model_state_bytes(N, precision=precision, optimizer=optimizer)
        for k in KEYS:
            assert got[k] == pytest.approx(ref[k]), f"{k} of N={N}, {optimizer}, {precision}"


# --- 4. largest_model_that_fits -------------------------------------------------------------


def test_largest_model_that_fits_80gb_device_holds_5b_params(ex):
    N = ex.largest_model_that_fits(80 * costmodel.GB)
    assert isinstance(N, (int, np.integer)) and not isinstance(N, bool), f"return an int, got {N!r}"
    assert N == 5_000_000_000
    # plain DP (ZeRO stage 0) keeps all 16 B/param on every rank, however many ranks there are
    assert costmodel.zero_memory_bytes(N, dp=64, stage=0) == 80 * costmodel.GB
    assert ex.largest_model_that_fits(80 * costmodel.GB, activation_bytes=1) == N - 1


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "sgd_nomomentum"])
def test_largest_model_that_fits_is_exactly_the_boundary(ex, optimizer, precision):
    rng = random.Random(f"{optimizer}-{precision}")
    def fits(k, device, act):
        return costmodel.model_state_bytes(k, precision, optimizer)["total"] + act <= device
    for _ in range(200):
        device = rng.randrange(1, 2 * 10**12)
        act = rng.choice([0, rng.randrange(0, device + 1)])
        N = ex.largest_model_that_fits(device, optimizer, precision, activation_bytes=act)
        assert fits(N, device, act) and not fits(N + 1, device, act), \
            f"device={device} B, activations={act} B: got N={N}"


def test_largest_model_that_fits_nothing_when_activations_fill_the_device(ex):
    assert ex.largest_model_that_fits(10 * costmodel.GB, activation_bytes=10 * costmodel.GB) == 0
    assert ex.largest_model_that_fits(10 * costmodel.GB, activation_bytes=12 * costmodel.GB) == 0
    assert ex.largest_model_that_fits(15) == 0  # less than one parameter's 16 bytes
    assert ex.largest_model_that_fits(16) == 1


# --- 5. predict_and_meter_allreduce_bytes ----------------------------------------------------

N_RANKS, NUMEL = 4, 1001  # 1001 = 4 * 250 + 1: the ring's chunks are 251, 250, 250, 250 elements


def _predict_and_meter_on_ranks(impl):
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(NUMEL, generator=g)
    before = x.clone()
    got = impl(x)
    return got, torch.equal(x, before)


@pytest.fixture(scope="module")
def metered(ex, launches):
    """Every rank's answer, from one launch of 4 ranks (the ranks' error fails each test)."""
    return launches(_predict_and_meter_on_ranks, ex.predict_and_meter_allreduce_bytes, timeout_s=TIMEOUT_S)


def _answers(metered):
    results = metered(N_RANKS)
    for r, (got, untouched) in enumerate(results):
        assert untouched, f"rank {r}: x was changed; all-reduce clones of it"
        assert isinstance(got, dict) and set(got) == {"ring", "recursive_doubling"}, f"rank {r}: {got!r}"
    return [got for got, _ in results]


def test_predict_and_meter_allreduce_bytes_predictions(metered):
    S, n = NUMEL * 4, N_RANKS
    for r, got in enumerate(_answers(metered)):
        assert got["ring"]["predicted"] == pytest.approx(2 * (n - 1) * S / n), f"rank {r}: ring"  # 6006 B
        assert got["recursive_doubling"]["predicted"] == pytest.approx(2 * S), f"rank {r}: log2(4) = 2 swaps"


def test_predict_and_meter_allreduce_bytes_measured_counts(metered):
    S, n, item = NUMEL * 4, N_RANKS, 4
    chunks = [c.numel() for c in torch.tensor_split(torch.empty(NUMEL), n)]  # torch's cut: 251, 250, ...
    answers = _answers(metered)
    for r, got in enumerate(answers):
        ring, rd = got["ring"], got["recursive_doubling"]
        # reduce-scatter sends every chunk but r's own, all-gather every chunk but r+1's
        want = (2 * NUMEL - chunks[r] - chunks[(r + 1) % n]) * item
        assert ring["measured"] == want, f"rank {r}: measured {ring['measured']} B, it sends {want} B"
        assert abs(ring["measured"] - ring["predicted"]) <= 2 * (n - 1) / n * item, f"rank {r}"
        assert rd["measured"] == rd["predicted"] == 2 * S, f"rank {r}: recursive doubling {rd}"
    assert sum(a["ring"]["measured"] for a in answers) == 2 * (n - 1) * S
