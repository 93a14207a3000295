"""Which test files each pass of ``make test`` runs, in one place: ``tests/conftest.py`` marks their tests
(``serial``, ``numerics``) and ``make`` passes the files themselves, so a pass that runs a few files does
not collect (import and assert-rewrite) all of them. ``python tests/_passes.py serial|deadlines|numerics``
prints a pass's files. No imports beyond the standard library: ``make`` runs this before each pass."""
import os
import sys
from pathlib import Path

#: Files whose tests hold a measured time to a prediction (a step against the cost model, a model that
#: must train in seconds): marked ``serial``, so ``make test`` runs them alone on the machine after the
#: rest has run two at a time (``pytest -n 2``), where another test's ranks would steal their cores.
SERIAL_FILES = {"test_predict.py", "test_pipeline_measured.py", "test_step_time.py"}

#: Files whose tests hold a deadline with room to spare (a timeout that must fire, a crash reported, the
#: processes gone within seconds): marked ``serial`` too, but run two at a time in a pass of their own
#: (``python tests/_passes.py deadlines``): they wait more than they compute, and their deadlines have
#: room for one such neighbour (two at a time passed every run here; four at a time, one missed), not
#: for the main pass's busy ranks.
DEADLINE_FILES = {"test_grade.py", "test_parameter_server.py", "test_hogwild.py", "test_launch_failures.py",
                  "test_launch_limits.py"}


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

#: Numerics files whose tests run at world sizes 2 and 4, and the parameter that is the world size. The
#: main pass runs both sizes; the portability pass only 2 (``conftest`` marks the rest ``wide``). The
#: bounds are one formula in the number of ranks, so a bound tuned to one CPU's rounding should show at
#: world size 2 under another MKL path too; leaving out the 4-rank runs (4 ranks on 2 cores: two thirds
#: of these files' time) keeps the pass near 2 minutes.
WORLD_PARAM = {"test_data_parallel.py": "n", "test_fsdp.py": "n", "test_fsdp_prefetch.py": "n",
               "test_zero.py": "n", "test_sharded_optimizer.py": "n", "test_scaler_sharded.py": "n",
               "test_pipeline.py": "p"}

#: Files outside the two sets above with a test held to wall-clock time (marked ``@pytest.mark.serial``
#: itself): a measured time in the serial pass, a deadline in the deadlines pass.
TIMED_TESTS_IN = {"test_dryrun.py", "test_models.py"}
DEADLINE_TESTS_IN = {"test_cli.py", "test_meters.py"}

PASSES = {"serial": SERIAL_FILES | TIMED_TESTS_IN, "deadlines": DEADLINE_FILES | DEADLINE_TESTS_IN,
          "numerics": NUMERICS_FILES}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PASSES:
        sys.exit(f"usage: python tests/_passes.py {'|'.join(PASSES)}")
    here = Path(__file__).parent
    print(" ".join(os.path.relpath(here / name) for name in sorted(PASSES[sys.argv[1]])))
