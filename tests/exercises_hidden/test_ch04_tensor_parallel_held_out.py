"""Chapter 04, held-out: head layouts the visible tests do not use (seeded), against the library's rule.
Exact: ranges and flags."""
import random

import pytest

from minitorch_dist.parallelism.tensor_parallel_llama import kv_heads_of_rank, kv_layout

pytestmark = pytest.mark.ch04


def _layouts(seed, n=12):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        n_kv = rng.choice([1, 2, 3, 4, 6, 8, 16])
        out.append((n_kv * rng.choice([1, 2, 3, 4, 5, 8]), n_kv))
    return out


@pytest.mark.parametrize("n_head,n_kv_head", _layouts(41))
def test_gqa_head_shard_random_layouts(ex, n_head, n_kv_head):
    group = n_head // n_kv_head
    for t in range(1, n_head + 1):
        try:
            layout = kv_layout(n_head, n_kv_head, t)
        except ValueError:
            with pytest.raises(ValueError, match="use t in"):
                ex.gqa_head_shard(n_head, n_kv_head, t, 0)
            continue
        seen = []
        for r in range(t):
            q, kv, replicated = ex.gqa_head_shard(n_head, n_kv_head, t, r)
            assert replicated == (layout == "replicated"), (n_head, n_kv_head, t, r)
            assert list(kv) == list(kv_heads_of_rank(n_head, n_kv_head, t, r)), (n_head, n_kv_head, t, r)
            assert {h // group for h in q} <= set(kv)
            seen += list(q)
        assert seen == list(range(n_head))
