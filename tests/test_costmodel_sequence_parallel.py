"""Chapter 05's formulas: the bytes per rank per layer of Megatron sequence parallelism
(Korthikanti et al. 2022 §4.2.2), DeepSpeed-Ulysses (Jacobs et al. 2023 §3.2) and ring attention
(Liu et al. 2023 §3), each re-derived here by counting the elements that leave a rank, and
their comparison: Megatron-SP == tensor parallelism, Ulysses O(s·h/t) per rank, ring O(s·h)
per rank whatever t. The measured side (the comm meter on real ranks) is in test_ulysses.py.

Tolerances: each count is a handful of float64 operations on integers against the same count summed
here: rel 1e-12 is far above k·u ~ 1e-15 and far below any wrong term.
"""
import pytest

from minitorch_dist import costmodel as cm

pytestmark = pytest.mark.ch05

SIZES = [(1, 64, 32, 1), (2, 64, 32, 2), (3, 96, 48, 4), (2, 128, 64, 8), (1, 1 << 16, 4096, 16)]
DEGREES = [1, 2, 4, 8, 16]


def _ring_collective_sent(n_elems, t):
    """Elements one rank sends in a ring reduce-scatter or all-gather of an n-element buffer:
    t-1 steps, one chunk of n/t each (counted step by step, not by the (t-1)/t factor)."""
    return sum(n_elems / t for _ in range(t - 1))


def _all_to_all_sent(shard_elems, t, r):
    """Elements rank r sends in an all-to-all of its shard cut in t equal blocks: every block
    whose destination is another rank."""
    return sum(shard_elems / t for dst in range(t) if dst != r)


# --- Megatron sequence parallelism -----------------------------------------------------------------


@pytest.mark.parametrize("b,s,h,t", SIZES)
@pytest.mark.parametrize("e", [2, 4])
def test_megatron_sp_sends_four_all_gathers_and_four_reduce_scatters(b, s, h, t, e):
    want = (4 + 4) * _ring_collective_sent(b * s * h, t) * e
    assert (cm.sequence_parallel_bytes_per_layer(b, s, h, t, bytes_per_element=e)
            == pytest.approx(want, rel=1e-12))
    want_closed = 8 * b * s * h * e * (t - 1) / t
    assert cm.sequence_parallel_bytes_per_layer(b, s, h, t, e) == pytest.approx(want_closed, rel=1e-12)


@pytest.mark.parametrize("b,s,h,t", SIZES)
def test_megatron_sp_moves_the_same_bytes_as_tensor_parallelism(b, s, h, t):
    """Korthikanti §4.2.2: a ring all-reduce is a reduce-scatter then an all-gather, so swapping
    each all-reduce for that pair (with LayerNorm / dropout in between) costs nothing extra."""
    assert cm.sequence_parallel_bytes_per_layer(b, s, h, t) == pytest.approx(
        cm.tensor_parallel_bytes_per_layer(b, s, h, t), rel=1e-12)
    sp = cm.sequence_parallel_collectives_per_layer()
    tp = cm.tensor_parallel_allreduces_per_layer()
    for phase in ("forward", "backward"):
        assert sp[phase]["all_gather"] == sp[phase]["reduce_scatter"] == tp[phase]


# --- Ulysses --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,s,h,t", SIZES)
def test_ulysses_sends_eight_shards_minus_what_each_rank_keeps(b, s, h, t):
    shard = b * (s // t) * h  # one of q, k, v, out on one rank: all heads, s/t tokens
    for r in range(t):  # the same on every rank
        want = 8 * _all_to_all_sent(shard, t, r) * 2
        assert cm.ulysses_bytes_per_layer(b, s, h, t) == pytest.approx(want, rel=1e-12)
    assert cm.ulysses_all_to_alls_per_layer() == {"forward": 4, "backward": 4}


def test_ulysses_forward_is_the_papers_4Nh_over_P_with_the_kept_block_removed():
    """Jacobs et al. §3.2: 3Nh (q, k, v) + Nh (out) aggregate over P ranks -> 4Nh/P per link,
    forward, batch 1; the exact count keeps 1/P of it at home: 4Nh/P · (P-1)/P."""
    N, h = 1 << 15, 2048
    for P in (2, 4, 8, 32):
        fwd = cm.ulysses_bytes_per_layer(1, N, h, P, bytes_per_element=1) / 2
        assert fwd == pytest.approx(4 * N * h / P * (P - 1) / P, rel=1e-12)
        assert 4 * N * h / P / 2 <= fwd < 4 * N * h / P  # the paper's figure, within the (P-1)/P factor


@pytest.mark.parametrize("t", [2, 4, 8, 16])
def test_ulysses_is_t_times_cheaper_than_megatron_sp_at_fixed_sequence(t):
    b, s, h = 2, 4096, 1024
    assert (cm.ulysses_bytes_per_layer(b, s, h, t) * t
            == pytest.approx(cm.sequence_parallel_bytes_per_layer(b, s, h, t), rel=1e-12))


def test_ulysses_falls_with_t_at_fixed_sequence_and_is_bounded_at_fixed_shard():
    b, s, h = 1, 1 << 14, 512
    fixed_s = [cm.ulysses_bytes_per_layer(b, s, h, t) for t in (2, 4, 8, 16)]
    assert all(x > y for x, y in zip(fixed_s, fixed_s[1:]))
    # (t-1)/t^2: 1/4 -> 15/256
    assert fixed_s[-1] == pytest.approx(fixed_s[0] * (15 / 256) / (1 / 4), rel=1e-12)
    shard = 1024  # weak scaling: s = t·shard tokens
    weak = [cm.ulysses_bytes_per_layer(b, t * shard, h, t) for t in (2, 4, 8, 16)]
    bound = 8 * b * shard * h * 2
    assert all(x < y < bound for x, y in zip(weak, weak[1:]))
    assert weak[0] == pytest.approx(bound / 2, rel=1e-12)
    assert weak[-1] == pytest.approx(bound * 15 / 16, rel=1e-12)


def test_ulysses_max_degree_is_the_head_count():
    for n_head in (1, 12, 32, 96):
        assert cm.ulysses_max_degree(n_head) == n_head
    with pytest.raises(ValueError, match="n_head"):
        cm.ulysses_max_degree(0)


# --- ring attention -------------------------------------------------------------------------------


def _ring_sent(b, s, h, t, tensors_per_step):
    """Simulate the ring: t-1 steps, at each a rank forwards the blocks it holds to rank r+1."""
    block = b * (s // t) * h
    sent = [0] * t
    for _ in range(t - 1):
        for r in range(t):
            sent[r] += tensors_per_step * block
    assert len(set(sent)) == 1
    return sent[0]


@pytest.mark.parametrize("b,s,h,t", SIZES)
@pytest.mark.parametrize("e", [2, 4])
def test_ring_attention_passes_k_v_forward_and_k_v_dk_dv_backward(b, s, h, t, e):
    got = cm.ring_attention_bytes_per_layer(b, s, h, t, bytes_per_element=e)
    if t == 1:  # no ring, no messages
        assert got == {"forward": 0, "backward": 0, "total": 0}
        return
    assert got["forward"] == _ring_sent(b, s, h, t, 2) * e  # K, V
    # K, V again for t-1 hops; the dK, dV accumulators one hop behind, plus the hop home
    assert got["backward"] == _ring_sent(b, s, h, t, 4) * e + 2 * b * (s // t) * h * e
    assert got["total"] == got["forward"] + got["backward"]
    assert got["total"] == pytest.approx((6 * t - 4) * b * (s // t) * h * e, rel=1e-12)
    half = cm.ring_attention_bytes_per_layer(b, s, h, t, bytes_per_element=2, acc_bytes=4)
    # the accumulators travel in fp32
    assert half["backward"] == _ring_sent(b, s, h, t, 2) * 2 + 2 * t * b * (s // t) * h * 4


def test_ring_is_flat_in_t_and_ulysses_is_not():
    """At fixed s: ring = (6t-4)/(8(t-1)) of Megatron-SP (both O(s·h), ring between 3/4 and 1 of
    it); Ulysses = 1/t of Megatron-SP, so ring exceeds Ulysses by t(6t-4)/(8(t-1))."""
    b, s, h = 1, 1 << 15, 1024
    for t in (2, 4, 8, 16):
        c = cm.sequence_parallel_comparison(b, s, h, t)
        assert c["ring"] == pytest.approx((6 * t - 4) / (8 * (t - 1)) * c["megatron_sp"], rel=1e-12)
        assert c["ulysses"] == pytest.approx(c["megatron_sp"] / t, rel=1e-12)
        assert c["ring"] > c["ulysses"]
    ring = [cm.ring_attention_bytes_per_layer(b, s, h, t)["total"] for t in (2, 4, 8, 16)]
    assert max(ring) / min(ring) < 2 and max(ring) <= 6 * b * s * h * 2  # bounded by 6bshe, independent of t


@pytest.mark.parametrize("fn", [cm.ulysses_bytes_per_layer, cm.sequence_parallel_bytes_per_layer,
                                lambda *a: cm.ring_attention_bytes_per_layer(*a)["total"]])
def test_all_three_grow_linearly_with_sequence_length_and_vanish_at_t_1(fn):
    b, h, t = 2, 256, 4
    base = fn(b, 1024, h, t)
    for k in (2, 4, 16):
        assert fn(b, 1024 * k, h, t) == pytest.approx(k * base, rel=1e-12)
    assert fn(b, 1024, h, 1) == 0


def test_bad_inputs_are_clear_errors():
    for fn in (cm.ulysses_bytes_per_layer, cm.ring_attention_bytes_per_layer):
        with pytest.raises(ValueError,
                           match="sequence length 30 is not divisible by the sequence-parallel degree 4"):
            fn(1, 30, 8, 4)
    for fn in (cm.ulysses_bytes_per_layer, cm.ring_attention_bytes_per_layer,
               cm.sequence_parallel_bytes_per_layer):
        with pytest.raises(ValueError, match="need t >= 1"):
            fn(1, 32, 8, 0)


def test_attention_activation_bytes_ring_linear_naive_quadratic():
    b, a, d, e = 2, 4, 16, 4
    for t in (1, 2, 4):
        for s in (64, 128):
            per_query = 4 * d * e + 4  # q, k, v, out rows in e bytes, a float32 log-sum-exp
            assert cm.ring_attention_activation_bytes(b, s, a, d, t, e) == b * a * (s // t) * per_query
    assert (cm.ring_attention_activation_bytes(b, 256, a, d, 4, e)
            == 2 * cm.ring_attention_activation_bytes(b, 128, a, d, 4, e))
    naive = [cm.naive_attention_activation_bytes(b, s, a, d, e) for s in (128, 256)]
    assert naive[0] == b * a * (3 * 128 * d + 128 * 128) * e
    assert naive[1] > 3 * naive[0]  # the s^2 probabilities dominate
    with pytest.raises(ValueError, match="sequence length 30 is not divisible"):
        cm.ring_attention_activation_bytes(1, 30, 1, 8, 4)


@pytest.mark.parametrize("b,h", [(1, 1024), (4, 8192)])
@pytest.mark.parametrize("e", [2, 4])
def test_ring_attention_min_block_is_where_a_blocks_compute_equals_its_send(b, h, e):
    flops, link = 400e12, 300e9
    c = cm.ring_attention_min_block_tokens(flops, link, e)
    compute = lambda n: 4 * b * n * n * h / flops  # one step: attend c queries to c keys (QK^T, PV)
    send = lambda n: 2 * b * n * h * e / link  # ... while sending the K and V blocks on
    assert compute(c) == pytest.approx(send(c), rel=1e-12)
    assert compute(2 * c) > send(2 * c) and compute(c / 2) < send(c / 2)
    assert cm.ring_attention_min_block_tokens(flops, link, e, causal=True) == pytest.approx(2 * c, rel=1e-12)
    if e == 2:  # 16-bit K and V: F / W
        assert c == pytest.approx(flops / link, rel=1e-12)
    with pytest.raises(ValueError, match="need positive"):
        cm.ring_attention_min_block_tokens(0, link)
