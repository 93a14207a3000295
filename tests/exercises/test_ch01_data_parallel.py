"""Chapter 01 exercises, autograded: gradient buckets, overlapped all-reduce hooks summing 16-bit
gradients in float32, accumulation over unequal micro-batches, bucketed hooks that rebuild their buckets.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: hand-worked bucket layouts, PyTorch's own
bucket assignment (``dist._compute_bucket_assignment_by_size``, what DDP's reducer runs), the
single-process gradient of the global batch, the comm meter, the order autograd delivers gradients
in (tensor hooks), and a counting DDP comm hook.

Adversarial inputs: branches each rank runs in its own order (buckets launched out of order, or
rebuilt from a rank's own order, pair the wrong tensors); a model whose first-registered layer runs
last (buckets never rebuilt overlap nothing); micro-batches of 3, 1 and 2 rows (a 1/k scale is the
mean of means); bfloat16 gradients (summed in bfloat16 they round at every step of the ring).

Tolerances (derived in tests/_support.py). The gradient comparisons (exercises 2-4) run in float64:
an averaged, accumulated or bucketed gradient is the single process's sum over the global batch's
rows in another grouping, and torch's DDP another grouping still. Their longest reduction has
N = 32 terms (a weight gradient over the 32 rows of 4 ranks' micro-batches of 8 rows in all; the
hidden width is 16), and the longest chain of dependent reductions is DEPTH = 7 (three linear layers
forward, two back, the weight gradient's sum over rows, the all-reduce): ``model_bound(n=N,
depth=DEPTH)`` scaled by the gradient's size; a mean loss, 4 deep; the weights after 3 SGD steps
(lr 0.1, momentum 0.9), ``sgd_bound`` of the gradients' bound. All are near 1e-10 of the values; a
rank's gradient not averaged is off by its share of the batch (1/2 or 1/4 of the gradient), a lost
micro-batch by 1/3, a 1-row micro-batch weighed as 2 rows by 1/6. The bfloat16 average (exercise 2)
is the float32 sum of n pre-divided bfloat16 gradients (dividing by 2 or 4 is exact), within
``gamma_n(fp32) * sum|g_r| / n`` of the exact average, then rounded once: ``u_bf16 * (|avg| + e) + e``
per element, against the float64 mean of the ranks' own gradients (exact: n bfloat16 values).
Bucket caps are given in bytes of float64 parameters (``ELEM = 8``): the same three buckets as
float32 parameters under half the caps. Exercise 5 counts float32 bytes and stays float32; its wire
bytes are a product of a few floats (rel 1e-9 >> 10 u).
"""
import random
import sys
import time

import cloudpickle
import pytest
import torch
import torch._dynamo  # DDP imports it when built: 2-6 s in every rank; once here, forked ranks inherit it
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from minitorch_dist import comm

from _support import close, float64, gamma, model_bound, roundoff, run_cases, sgd_bound

pytestmark = pytest.mark.ch01

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this
# file (whatever pytest's import mode). The exercise module is registered by value by `load`.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A rank stuck in a collective its peers never call fails after this long, naming each rank's
# last op, instead of launch's default 300 s.
TIMEOUT_S = 60
ELEM = 8  # bytes of a float64 element: exercises 2-4 run in float64


# --- 1. assign_buckets ----------------------------------------------------------------------------

HAND_WORKED = [
    # (sizes in registration order, cap, first cap, buckets)
    # four equal 4-byte params, cap 8: two per bucket, filled from the last param back
    ([4, 4, 4, 4], 8, None, [[3, 2], [1, 0]]),
    # 5 + 4 > 6 and 4 + 3 > 6 close the first two buckets; 3 + 2 + 1 = 6 fills the third exactly
    ([1, 2, 3, 4, 5], 6, None, [[4], [3], [2, 1, 0]]),
    # param 1 (100 B) is over the 5 B cap: it closes [3, 2] and gets a bucket of its own
    ([2, 100, 2, 2], 5, None, [[3, 2], [1], [0]]),
    # an oversize param first in line: alone, then the rest as usual
    ([2, 2, 2, 50], 4, None, [[3], [2, 1], [0]]),
    # a small first bucket (3 B) holds one param; later buckets take three (3 + 3 + 3 = 9)
    ([3, 3, 3, 3, 3], 9, 3, [[4], [3, 2, 1], [0]]),
    # the first cap may also be larger than the rest: 6 B first (three params), then 4 B (two)
    ([2, 2, 2, 2, 2, 2, 2], 4, 6, [[6, 5, 4], [3, 2], [1, 0]]),
    # everything fits in one bucket; a first cap smaller than every param still holds one
    ([1, 1, 1], 1000, None, [[2, 1, 0]]),
    ([5, 5], 100, 1, [[1], [0]]),
    # no parameters, no buckets
    ([], 8, None, []),
]


@pytest.mark.parametrize("sizes,cap,first,expected", HAND_WORKED)
def test_assign_buckets_hand_worked(ex, sizes, cap, first, expected):
    assert ex.assign_buckets(sizes, cap, first) == expected


def _check_bucket_rules(buckets, sizes, cap, first):
    """The rules of the docstring, checked one by one (they determine the answer uniquely)."""
    n = len(sizes)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(n)), f"each of the {n} indices exactly once, got {buckets}"
    assert flat == list(range(n - 1, -1, -1)), f"buckets fill in reverse registration order, got {buckets}"
    assert all(buckets), f"no empty buckets, got {buckets}"
    caps = [cap if first is None or j else first for j in range(len(buckets))]
    for j, (b, c) in enumerate(zip(buckets, caps)):
        total = sum(sizes[i] for i in b)
        assert total <= c or len(b) == 1, f"bucket {j} {b} holds {total} B > its cap {c} B"
        if j + 1 < len(buckets):  # it closed only because the next param did not fit
            nxt = buckets[j + 1][0]
            assert total + sizes[nxt] > c, \
                f"bucket {j} {b} ({total} B) closed although param {nxt} ({sizes[nxt]} B) fits its cap {c} B"


def test_assign_buckets_follows_the_rules_on_random_models(ex):
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(1, 40)
        cap = rng.choice([1, 7, 64, 1000, 4096])
        sizes = [rng.choice([0, 1, rng.randrange(1, 2 * cap + 2), rng.randrange(1, 5000)]) for _ in range(n)]
        first = rng.choice([None, 1, cap // 4 + 1, 3 * cap])
        _check_bucket_rules(ex.assign_buckets(sizes, cap, first), sizes, cap, first)


def _torch_buckets(sizes, cap, first):
    """DDP's own assignment, in the reverse order (as DDP's reducer rebuilds its buckets).

    ``_compute_bucket_assignment_by_size(tensors, limits, sparse, indices)`` walks ``tensors`` in
    the given order, labels them ``indices``, and uses ``limits[0]`` for the first bucket and
    ``limits[1]`` after. Returns (buckets, per-bucket limit). The sizes are float32 tensors.
    """
    tensors = [torch.empty(s // 4) for s in sizes]
    n = len(tensors)
    limits = [cap] if first is None else [first, cap]
    buckets, bucket_limits = dist._compute_bucket_assignment_by_size(
        tensors[::-1], limits, [False] * n, list(range(n - 1, -1, -1)))
    return buckets, bucket_limits


def test_assign_buckets_matches_pytorch_where_the_rules_agree(ex):
    # PyTorch's rule differs in one way: it closes a bucket once it *reaches* its limit, so the
    # parameter that crosses the limit stays in the bucket and a bucket may overfill (see the
    # next test). Whenever PyTorch's buckets all stay within their limits, every bucket but the
    # last sums to exactly its limit, and then the two rules give the same buckets. So we compare
    # exactly there: layouts built to fill every bucket exactly, and random models where
    # PyTorch's layout happens to fit.
    if not hasattr(dist, "_compute_bucket_assignment_by_size"):
        pytest.skip("this torch has no dist._compute_bucket_assignment_by_size")
    rng = random.Random(2)
    compared = 0
    for _ in range(300):
        cap, first = 4 * rng.randrange(1, 12), rng.choice([None, 4 * rng.randrange(1, 12)])
        if rng.random() < 0.5:  # built in reverse order, every bucket filled exactly, then a partial one
            sizes = []
            for j in range(rng.randrange(1, 6)):
                left = first if j == 0 and first is not None else cap
                while left:
                    sizes.append(4 * rng.randrange(1, left // 4 + 1))
                    left -= sizes[-1]
            sizes += [4] * rng.randrange(0, cap // 4)
            sizes.reverse()
        else:  # anything
            sizes = [4 * rng.randrange(1, 10) for _ in range(rng.randrange(1, 15))]
        theirs, limits = _torch_buckets(sizes, cap, first)
        if any(sum(sizes[i] for i in b) > lim for b, lim in zip(theirs, limits)):
            continue  # PyTorch overfilled a bucket: the rules disagree here by design
        assert ex.assign_buckets(sizes, cap, first) == theirs, f"sizes={sizes}, cap={cap}, first={first}"
        compared += 1
    assert compared >= 100, f"only {compared} layouts compared with PyTorch"


def test_assign_buckets_never_overfills_where_pytorch_does(ex):
    # the difference, hand-worked (registration-order sizes, cap 8 or 6 bytes):
    # [4, 16, 4], cap 8: 4 B fits, then the 16 B param would take the bucket to 20 B. Ours closes
    #   the bucket first, so 16 B sits alone: [[2], [1], [0]]. PyTorch adds it (20 >= 8 closes
    #   the bucket *after* it): [[2, 1], [0]].
    # [4, 4, 4], cap 6: ours [[2], [1], [0]] (4 + 4 > 6); PyTorch [[2, 1], [0]] (8 >= 6).
    assert ex.assign_buckets([4, 16, 4], 8) == [[2], [1], [0]]
    assert ex.assign_buckets([4, 4, 4], 6) == [[2], [1], [0]]
    if hasattr(dist, "_compute_bucket_assignment_by_size"):
        assert _torch_buckets([4, 16, 4], 8, None)[0] == [[2, 1], [0]]
        assert _torch_buckets([4, 4, 4], 6, None)[0] == [[2, 1], [0]]


# --- shared by exercises 2 and 3: a small MLP and a global batch ----------------------------------

IN, HIDDEN, OUT = 6, 16, 3


def _mlp() -> nn.Sequential:
    """The same initial weights on every rank and in the reference."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def _global_batch(rows: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(rows, IN, generator=g, dtype=torch.float64),
            torch.randn(rows, OUT, generator=g, dtype=torch.float64))


def _reference(x, y):
    """Single process: the gradients and the loss of the mean squared error on (x, y), in float64."""
    with float64():
        model = _mlp()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return [p.grad for p in model.parameters()], loss.item()


N = 4 * 8  # the longest reduction: 4 ranks' micro-batches of 8 rows in all (wider than HIDDEN = 16)
DEPTH = 7  # 3 linear layers forward, 2 back, the weight gradient's sum over rows, the all-reduce


def _grad_bound(ref):
    return model_bound(n=N, depth=DEPTH, scale=max(1.0, max(r.abs().max().item() for r in ref)))


def _assert_grads(got, ref, what, bound=None):
    """Each gradient (or weight) equal to the reference up to ``bound`` (default: the gradients')."""
    assert len(got) == len(ref)
    bound = _grad_bound(ref) if bound is None else bound
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g is not None, f"{what}: parameter {i} has no gradient"
        close(g, r, bound, f"{what}, parameter {i}")


# --- 2. install_gradient_averaging_hooks ------------------------------------------------------------

ROWS = 4  # rows of the global batch per rank


def _hooked_backward_on_ranks(install):
    with float64():
        return _hooked_backward(install)


def _hooked_backward(install):
    r, n = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    params = list(model.parameters())
    x, y = _global_batch(n * ROWS)
    x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
    handles = install(model)
    with comm.meter() as m:
        # the first layer's gradient is the last that backward produces: count the collectives
        # already launched when it arrives (a tensor hook runs before the grad is accumulated)
        before_first_layer = []
        model[0].weight.register_hook(lambda g: before_first_layer.append(len(m.events)))
        loss = F.mse_loss(model(x), y)
        t_start = time.perf_counter()
        loss.backward()
        t_end = time.perf_counter()
    out = {"grads": [p.grad.clone() for p in params], "ops": m.ops(),
           "nbytes": sorted(e.nbytes for e in m.events), "times": [e.t for e in m.events],
           "t_start": t_start, "t_end": t_end, "before_first_layer": before_first_layer,
           "handles": len(handles), "param_nbytes": sorted(p.numel() * p.element_size() for p in params)}
    # without the hooks, a backward is local again: no collectives, this rank's own gradient
    for h in handles:
        h.remove()
    model.zero_grad()
    with comm.meter() as m:
        F.mse_loss(model(x), y).backward()
    out["removed_ops"] = m.ops()
    out["removed_grads"] = [p.grad.clone() for p in params]
    return out


@pytest.fixture(scope="module")
def hooked(ex, launches):
    """`hooked(n)`: the per-rank results of _hooked_backward_on_ranks on n ranks, launched once per n."""
    return launches(_hooked_backward_on_ranks, ex.install_gradient_averaging_hooks, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("n", [2, 4])
def test_install_gradient_averaging_hooks_matches_single_process(hooked, n):
    ref, _ = _reference(*_global_batch(n * ROWS))
    for r, res in enumerate(hooked(n)):
        _assert_grads(res["grads"], ref, f"rank {r} of {n}")


@pytest.mark.parametrize("n", [2, 4])
def test_install_gradient_averaging_hooks_one_all_reduce_per_parameter(hooked, n):
    for r, res in enumerate(hooked(n)):
        nparams = len(res["param_nbytes"])
        assert res["ops"] == ["all_reduce"] * nparams, \
            f"rank {r}: collectives {res['ops']}; expected one comm.all_reduce per parameter ({nparams})"
        assert res["nbytes"] == res["param_nbytes"], \
            f"rank {r}: all-reduce sizes are not the parameters' sizes"
        assert res["handles"] == nparams, f"rank {r}: return one hook handle per parameter"


@pytest.mark.parametrize("n", [2, 4])
def test_install_gradient_averaging_hooks_launches_during_backward(hooked, n):
    for r, res in enumerate(hooked(n)):
        nparams = len(res["param_nbytes"])
        assert all(res["t_start"] <= t <= res["t_end"] for t in res["times"]), \
            f"rank {r}: every all-reduce must be launched inside loss.backward()"
        # the 2 params of the first layer remain; the other layers' all-reduces are under way
        assert res["before_first_layer"] and nparams - 2 <= res["before_first_layer"][0] <= nparams - 1, \
            f"rank {r}: {res['before_first_layer']} all-reduces launched before backward reached the first " \
            f"layer, expected {nparams - 2} or {nparams - 1}: start each one as soon as its gradient is ready"


def test_install_gradient_averaging_hooks_handles_remove_them(hooked):
    n = 2
    for r, res in enumerate(hooked(n)):
        assert res["removed_ops"] == [], f"rank {r}: hooks still communicate after handle.remove()"
        x, y = _global_batch(n * ROWS)
        local, _ = _reference(x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS])
        _assert_grads(res["removed_grads"], local, f"rank {r} after removing the hooks")


# bfloat16 gradients: summed in float32, rounded once. Each rank also computes its local gradient with an
# unhooked copy of the model (the same bfloat16 arithmetic), and the ranks gather those outside the meter:
# the exact average of what the ranks hold, in float64, is the reference.
BF16_ROWS = 8


def _bf16_on_ranks(install):
    import copy

    r, n = dist.get_rank(), dist.get_world_size()
    model = _mlp().to(torch.bfloat16)
    local = copy.deepcopy(model)
    x, y = _global_batch(n * BF16_ROWS)
    x, y = (t[r * BF16_ROWS:(r + 1) * BF16_ROWS].to(torch.bfloat16) for t in (x, y))
    F.mse_loss(local(x), y).backward()
    install(model)
    with comm.meter() as m:
        F.mse_loss(model(x), y).backward()
    everyone = []
    for p in local.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(n)]
        dist.all_gather(parts, p.grad)
        everyone.append(torch.stack([q.double() for q in parts]))
    return {"grads": [p.grad.clone() for p in model.parameters()], "everyone": everyone,
            "nbytes": [e.nbytes for e in m.events], "ops": [e.op for e in m.events],
            "numel": [p.numel() for p in model.parameters()]}


@pytest.fixture(scope="module")
def hooked_bf16(ex, launches):
    return launches(_bf16_on_ranks, ex.install_gradient_averaging_hooks, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("n", [2, 4])
def test_install_gradient_averaging_hooks_sums_bfloat16_in_float32(hooked_bf16, n):
    # the float32 sum of the n pre-divided gradients is within gamma_n(fp32) * sum|g_r| / n of the exact
    # average (dividing by n = 2 or 4 is exact); rounding it to bfloat16 once adds u_bf16 of it
    u16 = roundoff(torch.bfloat16)
    for r, res in enumerate(hooked_bf16(n)):
        assert sorted(res["nbytes"]) == sorted(4 * k for k in res["numel"]), \
            f"rank {r}: all-reduce sizes {res['nbytes']}; a bfloat16 gradient goes as a float32 copy " \
            f"(4 bytes per element)"
        for i, (g, every) in enumerate(zip(res["grads"], res["everyone"])):
            assert g.dtype == torch.bfloat16, f"rank {r}, parameter {i}: .grad is {g.dtype}, keep bfloat16"
            exact = every.mean(0)  # n bfloat16 values: their float64 sum is exact
            e = gamma(n, torch.float32) * every.abs().sum(0) / n
            bound = u16 * (exact.abs() + e) + e
            err = (g.double() - exact).abs()
            worst = int(torch.argmax(err - bound))
            assert bool((err <= bound).all()), \
                f"rank {r} of {n}, parameter {i}: off the float32 average by {err.flatten()[worst]:.3g} " \
                f"(allowed {bound.flatten()[worst]:.3g}, one bfloat16 rounding): sum in float32, round once"


# --- 3. accumulate_gradients --------------------------------------------------------------------

MICRO_ROWS = 2  # rows per micro-batch where they are equal
UNEVEN = (3, 1, 2)  # a short micro-batch in the middle: 1/k per micro-batch weighs its row 3 times too much
# (micro-batch sizes, no_sync) of each case, all run in one launch per world size
ACCUMULATE_CASES = {"equal": ((2, 2, 2), True), "uneven": (UNEVEN, True), "k1": ((2,), True),
                    "k4": ((1, 2, 2, 3), True), "every": (UNEVEN, False)}


def _counting_allreduce_hook(state, bucket):
    """A DDP comm hook: count the gradient elements all-reduced, then all-reduce as DDP does."""
    state["numel"] += bucket.buffer().numel()
    return default_hooks.allreduce_hook(None, bucket)


def _accumulate_on_ranks(accumulate):
    with float64():
        return run_cases({name: (lambda s=sizes, ns=no_sync: _accumulate(accumulate, s, ns))
                          for name, (sizes, no_sync) in ACCUMULATE_CASES.items()})


def _accumulate(accumulate, sizes, no_sync):
    r, n = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    ddp = DDP(model)
    synced = {"numel": 0}
    ddp.register_comm_hook(synced, _counting_allreduce_hook)
    rows_per_rank = sum(sizes)
    x, y = _global_batch(n * rows_per_rank)
    rows = slice(r * rows_per_rank, (r + 1) * rows_per_rank)  # this rank's micro-batches
    micro_batches = list(zip(x[rows].split(list(sizes)), y[rows].split(list(sizes))))

    synced_before = []  # gradient elements all-reduced before each micro-batch's forward

    def loss_fn(out, target):
        synced_before.append(synced["numel"])
        return F.mse_loss(out, target)

    loss = accumulate(ddp, loss_fn, micro_batches, no_sync=no_sync)
    return {"grads": [p.grad.clone() if p.grad is not None else None for p in model.parameters()],
            "loss": loss, "synced_before": synced_before, "synced": synced["numel"],
            "numel": sum(p.numel() for p in model.parameters())}


@pytest.fixture(scope="module")
def accumulated(ex, launches):
    return launches(_accumulate_on_ranks, ex.accumulate_gradients, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case_name", ["equal", "uneven", "every"])
@pytest.mark.parametrize("n", [2, 4])
def test_accumulate_gradients_matches_one_big_batch(accumulated, n, case_name):
    sizes, _ = ACCUMULATE_CASES[case_name]
    per_rank = sum(sizes)
    x, y = _global_batch(n * per_rank)
    ref, _ = _reference(x, y)
    for r, res in enumerate(accumulated.case(n, case_name)):
        _assert_grads(res["grads"], ref, f"rank {r} of {n}, micro-batches of {sizes} rows: the gradient of "
                                         f"the mean over all rows (weigh each micro-batch by its rows)")
        rows = slice(r * per_rank, (r + 1) * per_rank)
        _, local_loss = _reference(x[rows], y[rows])  # the mean over this rank's rows
        assert isinstance(res["loss"], float), \
            f"return the mean loss as a float, got {type(res['loss']).__name__}"
        loss_bound = model_bound(n=N, depth=4, scale=max(1.0, abs(local_loss)))  # 3 layers, then the mean
        assert abs(res["loss"] - local_loss) <= loss_bound, \
            f"rank {r}, micro-batches of {sizes} rows: returned {res['loss']}, the mean over all rows is " \
            f"{local_loss}"


@pytest.mark.parametrize("case_name", ["k1", "k4", "uneven"])
def test_accumulate_gradients_communicates_once_per_k_micro_batches(accumulated, case_name):
    k = len(ACCUMULATE_CASES[case_name][0])
    for r, res in enumerate(accumulated.case(2, case_name)):
        assert res["synced_before"] == [0] * k, \
            f"rank {r}: gradient elements all-reduced before each micro-batch: {res['synced_before']}; " \
            "run the first k-1 micro-batches under model.no_sync()"
        assert res["synced"] == res["numel"], \
            f"rank {r}: {res['synced']} gradient elements all-reduced, expected every one once " \
            f"({res['numel']})"


def test_accumulate_gradients_without_no_sync_communicates_every_micro_batch(accumulated):
    k = len(UNEVEN)
    for r, res in enumerate(accumulated.case(2, "every")):
        P = res["numel"]
        assert res["synced_before"] == [i * P for i in range(k)] and res["synced"] == k * P, \
            f"rank {r}: with no_sync=False every backward all-reduces all {P} gradient elements; " \
            f"got {res['synced_before']} before each micro-batch, {res['synced']} in all"


# --- 4. install_bucketed_gradient_hooks ------------------------------------------------------------

# The MLP's float64 gradients in registration order: W1 768 B, b1 128, W2 2048, b2 128, W3 384, b3 24.
# Filled from the end with a 512 B first bucket and 2200 B after: [b3, W3] (408 B; + b2 would be 536),
# [b2, W2] (2176 B), [b1, W1] (896 B). Three buckets; the last one holds the first layer. (The float32
# model makes the same buckets under caps of 256 B and 1100 B: every size and cap scales by ELEM / 4.)
CAP, FIRST_CAP = 1100 * ELEM // 4, 256 * ELEM // 4
STEPS_4, LR_4 = 3, 0.1


def _bucketed_on_ranks(install):
    with float64():
        return _bucketed(install)


def _bucketed(install):
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _global_batch(n * ROWS)
    x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
    model = _mlp()
    params = list(model.parameters())
    install(model, CAP, FIRST_CAP)
    opt = torch.optim.SGD(model.parameters(), lr=LR_4, momentum=0.9)
    reference = DDP(_mlp(), bucket_cap_mb=CAP / 2**20)  # torch's DDP, the same ranks and batch
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR_4, momentum=0.9)
    # the first layer's gradient is the last that backward produces: count the all-reduces already
    # launched when it arrives (a tensor hook runs before the grad is accumulated)
    probe = {"meter": None, "seen": []}
    model[0].weight.register_hook(lambda g: probe["seen"].append(len(probe["meter"].events)))
    arrived = []  # the order the gradients arrive in the first backward (what the rebuild follows)
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: arrived.append(i))
    first_grads, steps = None, []
    for _ in range(STEPS_4):
        probe["seen"] = []
        with comm.meter() as m:
            probe["meter"] = m
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
        # [e.op ...], not m.ops(): cloudpickle would take `ops` beside `torch` for torch.ops and fail
        steps.append({"sizes": [e.nbytes for e in m.events], "ops": [e.op for e in m.events],
                      "async": [e.async_op for e in m.events], "before_first_layer": probe["seen"]})
        if first_grads is None:
            first_grads = [p.grad.clone() for p in params]
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    return {"first_grads": first_grads, "params": [p.detach().clone() for p in params],
            "torch_params": [p.detach().clone() for p in reference.parameters()], "steps": steps,
            "bucket_sizes": _expected_buckets(params, arrived[:len(params)])}


def _expected_buckets(params, arrived):
    """The bucket sizes of the first backward (reverse registration order) and of the later ones (the
    first backward's arrival order), by the library's rule."""
    from minitorch_dist import costmodel

    sizes = [p.numel() * p.element_size() for p in params]
    out = []
    for order in (list(range(len(params)))[::-1], arrived):
        plan = costmodel.bucket_assignment([sizes[i] for i in order], CAP, FIRST_CAP)
        out.append([sum(sizes[order[i]] for i in b) for b in plan])
    return out


@pytest.fixture(scope="module")
def bucketed(ex, launches):
    """`bucketed(n)`: the per-rank results of _bucketed_on_ranks on n ranks, launched once per n."""
    return launches(_bucketed_on_ranks, ex.install_bucketed_gradient_hooks, timeout_s=TIMEOUT_S)


def _single_process_sgd(n):
    """One process on the global batch, in float64: the gradients of the first step, the weights after
    all, and the bound on those weights (STEPS_4 SGD steps on gradients within the gradients' bound)."""
    with float64():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR_4, momentum=0.9)
        x, y = _global_batch(n * ROWS)
        first, grad_err = None, 0.0
        for _ in range(STEPS_4):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            first = first or grads
            grad_err = max(grad_err, _grad_bound(grads))
            opt.step()
        weights_bound = sgd_bound(steps=STEPS_4, lr=LR_4, grad_err=grad_err, momentum=0.9)
        return first, [p.detach().clone() for p in model.parameters()], weights_bound


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_matches_single_process(bucketed, n):
    grads, weights, bound = _single_process_sgd(n)
    for r, res in enumerate(bucketed(n)):
        _assert_grads(res["first_grads"], grads, f"rank {r} of {n}, first step's gradients")
        _assert_grads(res["params"], weights, f"rank {r} of {n}, weights after {STEPS_4} SGD steps", bound)


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_matches_torch_ddp(bucketed, n):
    _, _, bound = _single_process_sgd(n)
    for r, res in enumerate(bucketed(n)):
        _assert_grads(res["params"], res["torch_params"], f"rank {r} of {n}, ours vs torch's DDP", bound)


def _check_launches(res, r, n, first_backward_launched=None):
    """Per backward: one async all-reduce per bucket, of its size, in bucket order (the first backward's
    buckets in reverse registration order, then one broadcast; the later ones' in the arrival order),
    all but the last launched before the first layer's gradient from the second backward on."""
    static, rebuilt = res["bucket_sizes"]
    for step, got in enumerate(res["steps"]):
        where = f"rank {r} of {n}, backward {step}"
        want = static if step == 0 else rebuilt
        ops = ["all_reduce"] * len(want) + (["broadcast"] if step == 0 else [])
        assert got["ops"] == ops, \
            f"{where}: collectives {got['ops']}; expected one comm.all_reduce per bucket ({len(want)})" + \
            (", then one comm.broadcast of the arrival order" if step == 0 else " and nothing else")
        assert got["sizes"][:len(want)] == want, \
            f"{where}: all-reduce sizes {got['sizes'][:len(want)]}, buckets in order {want} " + \
            ("(reverse registration order)" if step == 0 else
             "(rebuilt in the first backward's arrival order)")
        assert all(got["async"][:len(want)]), f"{where}: launch each bucket with async_op=True"
        launched = len(want) - 1 if step or first_backward_launched is None else first_backward_launched
        assert got["before_first_layer"] == [launched], \
            f"{where}: {got['before_first_layer']} all-reduces launched before backward reached the " \
            f"first layer; expected {launched}: launch each bucket once it and those before it are complete"


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_one_async_all_reduce_per_bucket_during_backward(bucketed, n):
    for r, res in enumerate(bucketed(n)):
        assert len(res["bucket_sizes"][1]) == 3, res["bucket_sizes"]
        _check_launches(res, r, n)


# A model whose first-registered layer runs last: registered l3, l2, l1, run l1 -> l2 -> l3. Reverse
# registration order puts l1 (whose gradients come last) in bucket 0, so the first backward overlaps
# nothing; buckets rebuilt in the arrival order overlap as the plain MLP's do. The same layers as _mlp.
class _RegisteredBackwards(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l3, self.l2, self.l1 = nn.Linear(HIDDEN, OUT), nn.Linear(HIDDEN, HIDDEN), nn.Linear(IN, HIDDEN)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _backwards_on_ranks(install):
    with float64():
        r, n = dist.get_rank(), dist.get_world_size()
        x, y = _global_batch(n * ROWS)
        x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        model = _RegisteredBackwards()
        params = list(model.parameters())
        install(model, CAP, FIRST_CAP)
        probe = {"meter": None, "seen": []}
        model.l1.weight.register_hook(lambda g: probe["seen"].append(len(probe["meter"].events)))
        arrived = []
        for i, p in enumerate(params):
            p.register_hook(lambda g, i=i: arrived.append(i))
        steps, grads = [], []
        for _ in range(3):
            probe["seen"] = []
            with comm.meter() as m:
                probe["meter"] = m
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(x), y).backward()
            steps.append({"sizes": [e.nbytes for e in m.events], "ops": [e.op for e in m.events],
                          "async": [e.async_op for e in m.events],
                          "before_first_layer": probe["seen"]})
            grads.append([p.grad.clone() for p in params])
        return {"steps": steps, "grads": grads,
                "bucket_sizes": _expected_buckets(params, arrived[:len(params)])}


@pytest.fixture(scope="module")
def registered_backwards(ex, launches):
    return launches(_backwards_on_ranks, ex.install_bucketed_gradient_hooks, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_rebuilds_buckets_in_arrival_order(registered_backwards, n):
    with float64():
        model = _RegisteredBackwards()
        x, y = _global_batch(n * ROWS)
        F.mse_loss(model(x), y).backward()
        ref = [q.grad for q in model.parameters()]
    for r, res in enumerate(registered_backwards(n)):
        static, rebuilt = res["bucket_sizes"]
        assert static != rebuilt and len(rebuilt) == 3, res["bucket_sizes"]  # the premise
        # first backward: bucket 0 holds l1's bias alone (its weight would pass FIRST_CAP) and closes only
        # once l1's gradients come, so at most that bucket is out before l1's weight gradient
        assert res["steps"][0]["before_first_layer"][0] <= 1, res["steps"][0]
        _check_launches(res, r, n, first_backward_launched=res["steps"][0]["before_first_layer"][0])
        for k, grads in enumerate(res["grads"]):
            _assert_grads(grads, ref, f"rank {r} of {n}, backward {k}")


# Gradients in another order on every other rank. Two branches of equal size, which rank r runs in an
# order that depends on r: autograd runs the branch created last first, so the odd ranks complete bucket 1
# (branch a) before bucket 0 (branch b). Buckets launched as they complete would still pair up (equal
# sizes) and each rank would average the wrong tensors together, silently. tanh(a(x)) * b(x): the two
# branches' gradients differ, so a swap shows.
BRANCH_CAP = (IN * OUT + OUT) * ELEM  # one branch (weight and bias) per bucket: two buckets


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x, flip: bool = False):
        if flip:
            yb = self.b(x)
            ya = self.a(x)
        else:
            ya = self.a(x)
            yb = self.b(x)
        return torch.tanh(ya) * yb


def _branches_on_ranks(install):
    with float64():
        r, n = dist.get_rank(), dist.get_world_size()
        x, y = _global_batch(n * ROWS)
        x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        model = _Branches()
        arrived = []  # the order this rank's gradients arrive in (the premise of the test)
        for i, p in enumerate(model.parameters()):
            p.register_hook(lambda g, i=i: arrived.append(i))
        install(model, BRANCH_CAP, None)
        grads = []
        for _ in range(3):  # the first backward, the rebuild, and one more on the rebuilt buckets
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x, flip=r % 2 == 1), y).backward()
            grads.append([q.grad.clone() for q in model.parameters()])
        return {"grads": grads, "arrived": arrived[:4]}


@pytest.fixture(scope="module")
def branches(ex, launches):
    return launches(_branches_on_ranks, ex.install_bucketed_gradient_hooks, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("n", [2, 4])
def test_install_bucketed_gradient_hooks_when_the_gradient_order_differs_by_rank(branches, n):
    with float64():
        model = _Branches()
        x, y = _global_batch(n * ROWS)
        F.mse_loss(model(x), y).backward()
        ref = [q.grad for q in model.parameters()]
    res = branches(n)
    assert res[0]["arrived"] != res[1]["arrived"], "the test's premise: ranks 0 and 1 see other orders"
    for r, got in enumerate(res):
        for k, grads in enumerate(got["grads"]):
            _assert_grads(grads, ref, f"rank {r} of {n} (its branches in {'b, a' if r % 2 else 'a, b'} "
                                      f"order), backward {k}: launch the buckets in bucket order")


# --- 5. predict_and_meter_ddp_traffic -----------------------------------------------------------------

K_MICRO, MICRO_SEQS, CAP_MB, FIRST_MB = 3, 2, 0.1, 0.02  # caps of 104,857 and 20,971 bytes


def _traffic_on_ranks(impl):
    from minitorch_dist.models import GPT, GPTConfig, MarkovCorpus

    r, n = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.tiny(block_size=16)
    corpus = MarkovCorpus(cfg.vocab_size)
    micro = [corpus.batch(i, MICRO_SEQS * n, 16, rank=r, world_size=n) for i in range(K_MICRO)]
    out = {}
    for no_sync in (True, False):
        torch.manual_seed(0)
        model = GPT(cfg)
        with comm.meter() as outer:  # the test's own count of what ran
            got = impl(model, micro, CAP_MB, FIRST_MB, no_sync=no_sync)
        seen = [e for e in outer.events if e.op == "all_reduce"]
        out[no_sync] = {"got": got, "seen_bytes": [e.nbytes for e in seen],
                        "seen_wire": sum(e.wire_bytes for e in seen),
                        "sizes": [p.numel() * p.element_size() for p in model.parameters()]}
    return out


@pytest.fixture(scope="module")
def traffic(ex, launches):
    """One launch of 2 ranks (float32: the bytes of the chapter's GPT)."""
    return launches(_traffic_on_ranks, ex.predict_and_meter_ddp_traffic, timeout_s=TIMEOUT_S)


def _traffic(traffic):
    return traffic(2)


@pytest.mark.parametrize("no_sync", [True, False])
def test_predict_and_meter_ddp_traffic_predictions(traffic, no_sync):
    from minitorch_dist import costmodel

    n = 2
    for r, res in enumerate(_traffic(traffic)):
        res = res[no_sync]
        sizes = res["sizes"][::-1]
        plan = costmodel.bucket_assignment(sizes, int(CAP_MB * 2**20), int(FIRST_MB * 2**20))
        buckets = [sum(sizes[i] for i in b) for b in plan]
        want = buckets * (1 if no_sync else K_MICRO)
        pred = res["got"]["predicted"]
        assert pred["all_reduce_bytes"] == want, f"rank {r}, no_sync={no_sync}: predicted {pred}"
        assert pred["wire_bytes"] == pytest.approx(2 * (n - 1) / n * sum(want), rel=1e-9), f"rank {r}"


@pytest.mark.parametrize("no_sync", [True, False])
def test_predict_and_meter_ddp_traffic_measured(traffic, no_sync):
    for r, res in enumerate(_traffic(traffic)):
        res = res[no_sync]
        measured, pred = res["got"]["measured"], res["got"]["predicted"]
        assert res["seen_bytes"], f"rank {r}: no all-reduce ran; run the DDP step inside the function"
        assert measured["all_reduce_bytes"] == res["seen_bytes"], \
            f"rank {r}, no_sync={no_sync}: measured {measured['all_reduce_bytes']}, " \
            f"the ranks ran {res['seen_bytes']}"
        assert measured["wire_bytes"] == pytest.approx(res["seen_wire"], rel=1e-9), f"rank {r}"
        assert measured["all_reduce_bytes"] == pred["all_reduce_bytes"], \
            f"rank {r}: prediction and count differ"
        assert measured["wire_bytes"] == pytest.approx(pred["wire_bytes"], rel=1e-9), f"rank {r}"
