"""MetaMemoryMeter counts a step's bytes per category from storages created and freed, on any device.

The anchors are independent of the meter: ``MemoryMeter`` on CPU (parameters, gradients, optimizer
state, saved activations), the same step on ``meta`` (same shapes and dtypes, so the same bytes),
hand counts of buffers the test allocates, and FSDP's own account of the bytes it gathers.

The FSDP test runs under torch's fake process group in a fresh process (``python
tests/test_meta_memory.py``) so this process never holds a process group; it prints one JSON line.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minitorch_dist.analysis.meta_memory import STEP_CATEGORIES, MetaMemoryMeter
from minitorch_dist.analysis.meters import CATEGORIES, MemoryMeter
from minitorch_dist.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.timeout(60)

F32 = 4


def gpt_step(device: str, meter_cls, math_attention: bool = False):
    """One AdamW step of the tiny GPT under ``meter_cls(model, opt).track()``; returns (meter, model)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig.tiny())
        x, y = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = meter_cls(model, opt)
    attention = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH) if math_attention \
        else torch.enable_grad()
    with attention, meter.track():
        model(x, y)[1].backward()
        opt.step()
    return meter, model


# --- (1) on CPU it agrees with MemoryMeter ------------------------------------------------------------
def test_cpu_step_agrees_with_memory_meter_on_every_shared_category():
    ref, model = gpt_step("cpu", MemoryMeter)
    new, _ = gpt_step("cpu", MetaMemoryMeter)
    ref_now = ref.current()
    for c in CATEGORIES:
        assert new.peak[c] == ref.peak[c], c
        assert new.final[c] == ref_now[c], c
    n_tensors = len(list(model.parameters()))
    P = F32 * model.num_params()  # tied wte / lm_head once
    assert (new.peak["parameters"], new.peak["gradients"]) == (P, P)
    assert new.peak["optimizer_state"] == 2 * P + F32 * n_tensors  # exp_avg, exp_avg_sq, a 0-d step each
    assert new.final["activations"] == new.final["temporaries"] == 0  # all freed by the end
    assert new.peak["temporaries"] > 0
    assert new.peak["total"] >= ref.peak["total"]  # the same states plus the temporaries
    assert new.peak["total"] == sum(new.at_peak[c] for c in STEP_CATEGORIES)
    table = new.report("B").splitlines()  # a header, its rule, a row per category and the total
    assert "temporaries" in new.report() and len(table) == len(STEP_CATEGORIES) + 3
    assert f"{float(new.peak['total']):.3f}" in table[-1] and set(table[1]) == {"-", " "}


# --- (2) on meta the same step gives the same bytes ---------------------------------------------------
def test_meta_step_equals_cpu_step_in_every_category():
    # On meta, scaled_dot_product_attention always takes its math path: ask CPU for the same one.
    cpu, _ = gpt_step("cpu", MetaMemoryMeter, math_attention=True)
    meta, model = gpt_step("meta", MetaMemoryMeter, math_attention=True)
    assert next(model.parameters()).is_meta
    assert meta.peak == cpu.peak
    assert meta.at_peak == cpu.at_peak
    assert meta.final == cpu.final
    assert meta.peak["activations"] > 0 and meta.peak["parameters"] == F32 * model.num_params()


# --- (3) temporaries: counted while they live, gone once freed ----------------------------------------
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_temporary_shows_in_the_peak_and_not_after(device):
    meter = MetaMemoryMeter()
    with meter.track():
        x = torch.randn(1000, device=device)
        y = x.view(10, 100)[2:]  # a view keeps the whole storage
        del x
        assert meter.current()["temporaries"] == 1000 * F32
        del y
        assert meter.current()["temporaries"] == 0
        z = torch.empty(10, dtype=torch.float64, device=device)
        v = torch.tensor([0.5] * 100)  # made below the dispatcher, then lifted (on the CPU)
    assert meter.peak["temporaries"] == meter.peak["total"] == 1000 * F32
    assert meter.final["temporaries"] == 10 * 8 + 100 * F32  # z and v are still alive at the end
    del z, v


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_storage_resized_in_the_block_counts_as_a_temporary(device):
    """FSDP frees a gathered unit by resizing its storage to 0 and gathers into it again."""
    buf = torch.empty(500, device=device)
    buf.untyped_storage().resize_(0)
    meter = MetaMemoryMeter()
    with meter.track():
        buf.untyped_storage().resize_(500 * F32)
        assert meter.current()["temporaries"] == 500 * F32
        buf.untyped_storage().resize_(0)
        assert meter.current()["temporaries"] == 0
    assert meter.peak["temporaries"] == 500 * F32
    assert "resize_" not in vars(torch.UntypedStorage)  # the block's hook is gone


def test_inputs_from_before_the_block_count_only_while_saved():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)  # made before the block: not the step's allocation
    meter = MetaMemoryMeter()  # no model: the parameter is found as an op's argument
    with meter.track():
        (x @ w).sum().backward()
    assert meter.peak["parameters"] == 8 * 8 * F32
    assert meter.peak["activations"] == 4 * 8 * F32  # x, saved by the matmul for w's gradient
    assert meter.final["gradients"] == 8 * 8 * F32 and meter.final["activations"] == 0


def test_saved_buffers_and_plain_aliases_of_parameters_are_not_activations():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8))
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x):
            return (x * self.scale * self.w.data).exp()  # a mul saves its other operand, exp its output

    model, x = Scaled(), torch.randn(4, 8, requires_grad=True)
    meter = MetaMemoryMeter(model)
    with meter.track():
        model(x).sum().backward()
    assert meter.peak["activations"] == 4 * 8 * F32  # exp's output; not scale, not w's storage
    assert meter.peak["parameters"] == 8 * F32
    ref = MemoryMeter(model)
    with ref.track():
        model(x).sum().backward()
    assert ref.peak["activations"] == meter.peak["activations"]


def test_weights_bound_over_a_buffer_made_in_the_block_are_temporaries_not_parameters():
    """As an FSDP unit's gathered weights: nn.Parameters over a buffer allocated inside the block."""
    x = torch.randn(4, 8, requires_grad=True)
    meter = MetaMemoryMeter()
    with meter.track():
        full = torch.empty(8 * 8 + 4)  # a unit's flat buffer, padded
        w = torch.nn.Parameter(full[:64].view(8, 8))
        (x @ w).sum().backward()  # saves x and w
        del w, full
    assert meter.peak["parameters"] == 0
    assert meter.peak["activations"] == 4 * 8 * F32  # x only: a saved parameter is not an activation
    assert meter.peak["temporaries"] >= 68 * F32
    assert meter.final["temporaries"] == 4 * 8 * F32  # x.grad: not a parameter's gradient


def test_state_the_optimizer_creates_counts_as_optimizer_state_from_the_next_op():
    class Momentum(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self):
            for p in self.param_groups[0]["params"]:
                self.state[p]["buf"] = torch.zeros_like(p)
                torch.zeros(())  # the next op: the meter samples
                seen.append(meter.current()["optimizer_state"])
                p.data.add_(self.state[p]["buf"])

    lin, seen = torch.nn.Linear(10, 10, bias=False), []
    opt = Momentum(lin.parameters())
    meter = MetaMemoryMeter(lin, opt)
    with meter.track():
        lin(torch.randn(2, 10)).sum().backward()
        opt.step()
    assert seen == [100 * F32]
    assert meter.peak["optimizer_state"] == meter.final["optimizer_state"] == 100 * F32


def test_a_buffer_from_before_the_block_that_the_block_grows_counts_as_a_temporary():
    lin = torch.nn.Linear(10, 10, bias=False)
    lin.weight.grad = g = torch.zeros(10, 10)
    meter = MetaMemoryMeter(lin)
    with meter.track():
        assert meter.current()["gradients"] == 100 * F32
        lin.weight.grad = None  # g is no gradient any more, and it was not allocated in the block
        g.resize_(1000)
        assert meter.current()["temporaries"] == 1000 * F32 and meter.current()["gradients"] == 0
    del g


def test_gradients_are_counted_as_autograd_accumulates_them():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    loss = model(torch.randn(8, 16)).sum()
    meter = MetaMemoryMeter(model)
    with meter.track():
        loss.backward()
        model.zero_grad(set_to_none=True)  # gone before the block ends
    assert meter.peak["gradients"] == F32 * sum(p.numel() for p in model.parameters())
    assert meter.final["gradients"] == 0


def test_nesting_one_meter_is_refused():
    meter = MetaMemoryMeter()
    with meter.track(), pytest.raises(RuntimeError, match="already active"):
        with meter.track():
            pass


# --- (4) FSDP on meta under the fake process group ----------------------------------------------------
def fsdp_worker() -> dict:
    """One rank (1 of 8) of a fully sharded meta GPT: two steps, measured; plain numbers out."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from minitorch_dist.analysis.fsdp_observers import GatheredUnits
    from minitorch_dist.memory.zero.fsdp import fully_shard, sharded_units
    from minitorch_dist.runtime import comm, observe

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_embd=36, n_head=4))  # 36-wide: units that do not split evenly in 8
        x, y = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    psi = model.num_params()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter, steps = MetaMemoryMeter(model, opt), []
    for _ in range(2):  # the second one prefetches the next unit while one computes
        with meter.track(), observe.watching(GatheredUnits()) as gathered:
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        steps.append({"peak": meter.peak, "final": meter.final, "gathered_peak": gathered.peak_bytes})
    units = sharded_units(model)
    before, coll = torch.empty(1000, device="meta"), MetaMemoryMeter()
    with coll.track():  # a collective returns its arguments: not an allocation
        comm.all_reduce(before)
        out = torch.empty(8000, device="meta")  # this one is
        comm.all_gather(out, before)
        del out
    return {"collective_peak": coll.peak["temporaries"], "psi": psi, "steps": steps,
            "full_bytes": [u.full_bytes for u in units],
            "shard_bytes": [u.shard_numel * F32 for u in units], "n_tensors": len(list(model.parameters()))}


@pytest.fixture(scope="module")
def fsdp_run():
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], capture_output=True, text=True,
                          timeout=50, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fsdp_rank_holds_one_eighth_of_the_model_states(fsdp_run):
    n, psi, shard = 8, fsdp_run["psi"], sum(fsdp_run["shard_bytes"])
    units = len(fsdp_run["full_bytes"])
    assert F32 * psi / n <= shard <= F32 * (psi / n + units)  # padding: < 1 element per unit per rank
    assert shard > F32 * psi / n  # this model's units are padded
    for step in fsdp_run["steps"]:
        assert step["peak"]["parameters"] == step["final"]["parameters"] == shard
        assert step["peak"]["gradients"] == shard  # one reduce-scattered shard per unit
        assert step["final"]["gradients"] == 0  # zero_grad() freed them
        # exp_avg and exp_avg_sq of each piece (rank 1's shards hold no padding) and a 0-d step each
        assert step["final"]["optimizer_state"] == 2 * shard + F32 * fsdp_run["n_tensors"]


def test_collectives_results_are_not_new_allocations(fsdp_run):
    assert fsdp_run["collective_peak"] == 8000 * F32


def test_fsdp_gathered_units_are_temporaries(fsdp_run):
    biggest = max(fsdp_run["full_bytes"])
    for step in fsdp_run["steps"]:
        # FSDP's own count of the bytes it held gathered at once (the root's unit and a block's, then
        # with prefetch two blocks') is in there
        assert step["peak"]["temporaries"] >= step["gathered_peak"] >= biggest
        assert step["final"]["temporaries"] == 0  # every unit resharded, every bucket freed
        assert step["peak"]["parameters"] < biggest  # gathered weights are not this rank's parameters
    first, second = fsdp_run["steps"]
    # the second step prefetches: one more block gathered at the peak, and nothing else changes
    assert second["gathered_peak"] - first["gathered_peak"] == fsdp_run["full_bytes"][1]
    assert second["peak"]["temporaries"] - first["peak"]["temporaries"] == fsdp_run["full_bytes"][1]


if __name__ == "__main__":
    print(json.dumps(fsdp_worker()))
