"""Chapter 02, held out: byte-balanced key ranges on the parameter shapes of a small transformer (an
embedding table, attention and MLP matrices, biases and norms: sizes that differ by four orders of
magnitude), against an exhaustive search on a coarse copy and a feasibility argument on the full one;
and server_of on those ranges against a scan. Loads and indices are integers: compared exactly.
"""
import itertools

import pytest

pytestmark = pytest.mark.ch02


def _transformer_keys(layers=2, d=64, vocab=1000):
    sizes = [vocab * d]  # the embedding
    for _ in range(layers):
        sizes += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    sizes += [d, d]
    return [4 * s for s in sizes]


def _fewest_ranges(sizes, cap):
    ranges, load = 1, 0
    for b in sizes:
        if load + b > cap:
            ranges, load = ranges + 1, 0
        load += b
    return ranges


@pytest.mark.parametrize("servers", [2, 3, 5, 8, 40])
def test_balanced_key_ranges_transformer_shapes(ex, servers):
    sizes = _transformer_keys()
    rs = ex.balanced_key_ranges(sizes, servers)
    assert len(rs) == servers and rs[0].start == 0 and rs[-1].stop == len(sizes)
    assert all(a.stop == b.start for a, b in zip(rs, rs[1:]))
    load = max(sum(sizes[k] for k in r) for r in rs)
    # optimal: a largest load one byte smaller needs more ranges than servers
    assert load == max(sizes) or _fewest_ranges(sizes, load - 1) > servers, f"{servers} servers: {load}"
    for key in range(len(sizes)):
        assert key in rs[ex.server_of(key, rs)]


def test_balanced_key_ranges_exhaustive_on_a_coarse_copy(ex):
    sizes = [s // 4096 for s in _transformer_keys(layers=1, d=32, vocab=300)][:9]
    for servers in (2, 3, 4):
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *c, len(sizes)), (*c, len(sizes))))
                   for c in itertools.combinations_with_replacement(range(len(sizes) + 1), servers - 1))
        rs = ex.balanced_key_ranges(sizes, servers)
        assert max(sum(sizes[k] for k in r) for r in rs) == best, f"{servers} servers: {rs}"
