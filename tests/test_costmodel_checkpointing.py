"""Chapter 07's formulas, each derived again here: saved bytes with k checkpoints (Chen et al. 2016
§4.3) against an event-by-event simulation of forward and backward, the optimum k by brute force
and its √n scaling, the O(log n) recursion (Chen §4.4) simulated, recompute FLOPs (Korthikanti et
al. 2022 §5) from a list of the layer's matmuls, offload bytes (vDNN §3). The measured side is in
test_checkpointing.py and test_activation_offload.py.

Tolerances: byte counts and optima are integers, compared exactly; FLOP ratios are a few float64
operations against the same ratio summed here (rel 1e-12 >> k·u ~ 1e-15)."""
import math

import pytest

from minitorch_dist import costmodel as cm

pytestmark = pytest.mark.ch07


# --- an independent simulator of a checkpointed chain ------------------------------------------------

def _simulate(sizes, L, b, checkpoint_last=True):
    """Walk forward then backward through segments of ``sizes`` layers; return the peak live bytes.

    Forward: a checkpointed segment keeps its input (b) and saves nothing inside; a normal one
    saves L per layer. Backward, last segment first: a checkpointed segment re-runs its layers
    saving L each, then each layer's backward frees its L; then the segment's input is freed."""
    live = peak = 0
    ckpt = [True] * len(sizes)
    if not checkpoint_last:
        ckpt[-1] = False
    for s, c in zip(sizes, ckpt):
        if c:
            live += b
            peak = max(peak, live)
        else:
            for _ in range(s):
                live += L
                peak = max(peak, live)
    for s, c in reversed(list(zip(sizes, ckpt))):
        if c:
            for _ in range(s):  # recompute
                live += L
                peak = max(peak, live)
        for _ in range(s):  # back-propagate layer by layer
            live -= L
        if c:
            live -= b
    assert live == 0
    return peak


def _split(n, k):
    """k segments of n layers, sizes differing by at most one, longer first (written out again)."""
    sizes, left = [], n
    for j in range(k):
        sizes.append(-(-left // (k - j)))  # ceil of what is left over the segments left
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("L,b", [(1, 1), (10, 1), (1, 10), (34, 2), (7, 3)])
@pytest.mark.parametrize("checkpoint_last", [True, False])
def test_checkpoint_saved_bytes_matches_simulation(L, b, checkpoint_last):
    for n in range(1, 41):
        for k in range(1, n + 1):
            sizes = _split(n, k)
            assert cm.segment_sizes(n, k) == sizes
            want = _simulate(sizes, L, b, checkpoint_last)
            assert cm.checkpoint_saved_bytes(n, L, b, k, checkpoint_last) == want, (n, k)
            assert cm.checkpoint_saved_bytes(n, L, b, sizes[::-1], checkpoint_last) == \
                _simulate(sizes[::-1], L, b, checkpoint_last)


def test_special_cases_and_chens_formula():
    n, L, b = 12, 34.0, 2.0
    assert cm.checkpoint_saved_bytes(n, L, b, None) == n * L  # no checkpointing
    assert cm.checkpoint_saved_bytes(n, L, b, n) == n * b + L  # every layer
    assert cm.checkpoint_saved_bytes(n, L, b, 1) == b + n * L
    assert cm.checkpoint_saved_bytes(n, L, b, 1, checkpoint_last=False) == n * L
    for k in (1, 2, 3, 4, 6, 12):  # k divides n: Chen's k·b + (n/k)·L exactly
        assert cm.checkpoint_saved_bytes(n, L, b, k) == k * b + (n // k) * L
    for k in range(1, 13):  # otherwise bounded by the ceil form
        assert cm.checkpoint_saved_bytes(n, L, b, k) <= k * b + math.ceil(n / k) * L


def test_optimal_segments_is_the_brute_force_argmin():
    for n in (1, 2, 5, 16, 37, 100):
        for L, b in ((1, 1), (8, 1), (1, 8), (34, 2)):
            for last in (True, False):
                costs = [_simulate(_split(n, k), L, b, last) for k in range(1, n + 1)]
                ties = [k for k in range(1, n + 1) if costs[k - 1] == min(costs)]
                kstar = math.sqrt(n * L / b)
                nearest = min(abs(k - kstar) for k in ties)
                assert cm.optimal_segments(n, L, b, last) == min(k for k in ties if abs(k - kstar) == nearest)


def test_optimum_scales_as_sqrt_n():
    # L = b: for n = m^2 the optimum is exactly k = m = √n and the peak 2√n·b (Chen's O(2√n))
    for m in (2, 3, 5, 10, 31):
        n = m * m
        assert cm.optimal_segments(n, 1, 1) == m
        if n < 200:  # the simulation is quadratic in n
            assert min(_simulate(_split(n, k), 1, 1) for k in range(1, n + 1)) == 2 * m
    # in general k* ≈ √(n·L/b) and the peak is 2√(n·L·b) to within a layer and a boundary: the last
    # segment is a short one, so k·b + floor(n/k)·L >= k·b + (n/k - 1)·L >= 2√(n·L·b) - L
    for n, L, b in ((400, 9, 1), (1000, 1, 4), (900, 25, 4), (3000, 3, 2)):
        k = cm.optimal_segments(n, L, b)
        kstar = math.sqrt(n * L / b)
        assert abs(k - kstar) / kstar < 0.1
        peak, ideal = cm.checkpoint_saved_bytes(n, L, b, k), 2 * math.sqrt(n * L * b)
        assert ideal - L <= peak <= ideal + L + b
    # quadrupling n doubles the optimal peak (for large n)
    r = cm.checkpoint_saved_bytes(1600, 1, 1, cm.optimal_segments(1600, 1, 1)) / \
        cm.checkpoint_saved_bytes(400, 1, 1, cm.optimal_segments(400, 1, 1))
    assert r == pytest.approx(2.0)


# --- Chen §4.4: the recursion ------------------------------------------------------------------------

def _simulate_recursive(n, L, b):
    """Run the binary recursion event by event; return (peak live bytes, layer forwards)."""
    state = {"live": b, "peak": b, "fwd": 0}  # the chain's input is kept

    def add(x):
        state["live"] += x
        state["peak"] = max(state["peak"], state["live"])

    def backprop(lo, hi):  # layers [lo, hi); the input of layer lo is alive
        if hi - lo == 1:
            state["fwd"] += 1
            add(L)  # forward with saving, then its backward frees it
            add(-L)
            return
        mid = lo + (hi - lo + 1) // 2
        state["fwd"] += mid - lo  # forward [lo, mid) without saving
        add(b)  # keep the input of layer mid
        backprop(mid, hi)
        add(-b)
        backprop(lo, mid)

    backprop(0, n)
    return state["peak"], state["fwd"]


def test_log_checkpoint_matches_simulation_and_closed_forms():
    L, b = 5, 3
    for n in range(1, 130):
        peak, fwd = _simulate_recursive(n, L, b)
        assert cm.log_checkpoint_saved_bytes(n, L, b) == peak, n
        assert cm.log_checkpoint_forwards(n) == fwd, n
    for p in range(0, 11):  # n = 2^p: (1 + p)·b + L bytes and n + (n/2)·p forwards
        n = 2**p
        assert cm.log_checkpoint_saved_bytes(n, L, b) == (1 + p) * b + L
        assert cm.log_checkpoint_forwards(n) == n + n * p // 2
    # the trade: less memory than √n segments, more compute than their 2n forwards
    n = 1024
    assert cm.log_checkpoint_saved_bytes(n, 1, 1) < cm.checkpoint_saved_bytes(n, 1, 1, 32)
    assert cm.log_checkpoint_forwards(n) > 2 * n


# --- recompute FLOPs ---------------------------------------------------------------------------------

def _layer_matmul_flops(s, h):
    """One layer's forward matmuls for one sequence, 2 FLOPs per multiply-add."""
    return {"qkv": 2 * s * h * 3 * h, "scores": 2 * s * s * h, "attn_v": 2 * s * s * h,
            "proj": 2 * s * h * h, "fc": 2 * s * h * 4 * h, "fc_out": 2 * s * 4 * h * h}


@pytest.mark.parametrize("s,h,l,V", [(2048, 12288, 96, 51200), (2048, 20480, 105, 51200), (64, 64, 2, 64),
                                     (4096, 4096, 32, 32000)])
def test_recompute_overhead_from_the_matmuls(s, h, l, V):
    layer = _layer_matmul_flops(s, h)
    forward = l * sum(layer.values()) + 2 * s * h * V
    step = 3 * forward  # backward = 2 forwards
    full = l * sum(layer.values())  # the layers run forward once more; the logits do not
    selective = l * (layer["scores"] + layer["attn_v"])
    kw = dict(seq=s, hidden=h, layers=l, vocab=V)
    assert cm.recompute_overhead("none", **kw) == 0
    assert cm.recompute_overhead("full", **kw) == pytest.approx(full / step, rel=1e-12)
    assert cm.recompute_overhead("selective", **kw) == pytest.approx(selective / step, rel=1e-12)
    assert (cm.recompute_overhead("selective", relative_to="forward", **kw)
            == pytest.approx(selective / forward))
    assert cm.recompute_overhead("full", **kw) < 1 / 3


def test_recompute_overhead_paper_numbers():
    assert cm.recompute_overhead("full") == pytest.approx(1 / 3)
    assert cm.recompute_overhead("full", relative_to="forward") == pytest.approx(1.0)
    # Korthikanti et al. §5: selective recompute costs 2.7% (GPT-3) and 1.6% (MT-NLG) of the FLOPs
    # -- of the *forward*; a third of that of the whole step.
    gpt3 = cm.recompute_overhead("selective", 2048, 12288, 96, 51200, relative_to="forward")
    mtnlg = cm.recompute_overhead("selective", 2048, 20480, 105, 51200, relative_to="forward")
    assert round(100 * gpt3, 1) == 2.7 and round(100 * mtnlg, 1) == 1.6
    assert cm.recompute_overhead("selective", 2048, 12288, 96, 51200) == pytest.approx(gpt3 / 3)


def test_activation_offload_bytes_and_errors():
    assert cm.activation_offload_bytes(1000) == {"to_host": 1000, "to_device": 1000, "total": 2000}
    with pytest.raises(ValueError, match="saved_bytes"):
        cm.activation_offload_bytes(-1)
    with pytest.raises(ValueError, match="segments"):
        cm.checkpoint_saved_bytes(4, 1, 1, 5)
    with pytest.raises(ValueError, match="sum to n_layers"):
        cm.checkpoint_saved_bytes(4, 1, 1, [1, 2])
    with pytest.raises(ValueError, match="n_layers"):
        cm.optimal_segments(0, 1, 1)
    with pytest.raises(ValueError, match="needs seq, hidden and layers"):
        cm.recompute_overhead("selective")
    with pytest.raises(ValueError, match="unknown recompute policy"):
        cm.recompute_overhead("some")
