"""Suite-wide rules: `gpu` tests skip with a reason where there is no CUDA GPU; every test starts
from the same random state (torch, Python's `random`, NumPy seeded with 0), so a test that draws
unseeded numbers still sees the same ones whatever ran before it or alone; tests timed against a
prediction or a limit are marked ``serial`` (run alone by ``make test``); tests whose floating-point
results depend on the CPU's rounding are marked ``numerics`` (run again under another MKL code path by
``.ci/run``); and the report's header
says which implementation the exercise tests load (your stubs or the worked solutions)."""
import os
import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def pytest_report_header(config):
    from minitorch_dist.course import exercises, registry

    if os.environ.get("MTD_IMPL"):
        return f"exercise tests load: {os.environ['MTD_IMPL']} (MTD_IMPL)"
    yours = [ch.tag for ch in registry.CHAPTERS if exercises.resolve_impl(chapter=ch) == "exercises"]
    if len(yours) == len(registry.CHAPTERS):
        return "exercise tests load: your stubs in exercises/ (MTD_IMPL=solutions|exercises forces one)"
    mine = f", except your filled-in stubs of {', '.join(yours)}" if yours else ""
    return (f"exercise tests load: the worked solutions in solutions/{mine} "
            f"(MTD_IMPL=exercises|solutions forces one)")


#: Files whose tests hold wall-clock time to a prediction or a limit (a measured step against the cost
#: model, a timeout that must fire in time): marked ``serial``, so ``make test`` runs them alone on the
#: machine after the rest has run two at a time (``pytest -n 2``), where another test's ranks would
#: steal their cores. A single timed test in another file carries ``@pytest.mark.serial`` itself.
SERIAL_FILES = {"test_predict.py", "test_grade.py", "test_pipeline_measured.py", "test_parameter_server.py",
                "test_hogwild.py", "test_step_time.py", "test_launch_failures.py", "test_launch_limits.py"}


#: Files whose tests compare floating-point results that another CPU rounds differently: equal to one
#: process or to torch, resilience, compression, kernels, figures. Marked ``numerics``; ``.ci/run`` runs
#: them once more under another MKL code path (``make test-portability``), so a bound tuned to one CPU's
#: rounding turns CI red on the machine that wrote it. Files whose comparisons are bitwise by design, and
#: the exercise tests (the same library code), are left to the main run: the pass stays near 2 minutes.
NUMERICS_FILES = {
    "test_data_parallel.py", "test_fsdp.py", "test_fsdp_prefetch.py", "test_zero.py",
    "test_sharded_optimizer.py", "test_tensor_parallel.py", "test_tensor_parallel_vocab.py",
    "test_megatron_sp.py", "test_ulysses.py", "test_ring_attention.py", "test_llama.py",
    "test_llama_parallel.py", "test_three_d.py", "test_three_d_llama.py", "test_pipeline.py",
    "test_pipeline_v.py", "test_pipeline_llama.py", "test_expert_parallel.py", "test_moe.py",
    "test_moe_gpt.py", "test_moe_modern.py", "test_mixed_precision.py", "test_fp8.py", "test_fp8_linear.py",
    "test_compression.py", "test_activation_compression.py", "test_resilience.py", "test_kernels.py",
    "test_attention_tiled.py", "test_figures.py", "test_scaler_sharded.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
        if item.path.name in NUMERICS_FILES:
            item.add_marker(pytest.mark.numerics)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
