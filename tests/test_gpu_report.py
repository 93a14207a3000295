"""The GPU report (``make gpu-report``): without CUDA it says so, exits 0 and writes nothing; the
writer turns a result dict into a JSON file and PNGs; one failing section is recorded and the rest
still run. The measuring functions are device-agnostic, so their logic runs here on CPU ranks (gloo)
with tiny sizes; the real thing, on a GPU, is the ``gpu`` test at the end."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minitorch_dist.analysis import gpu_bench as gb
from minitorch_dist.analysis import gpu_report as g
from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch00

PNG = b"\x89PNG\r\n\x1a\n"


def _fake_result() -> dict:
    ops = {op: [{"bytes": b * gb.MiB, "seconds": 1e-3 * b, "algbw_GBps": 100.0, "busbw_GBps": 150.0 + b}
                for b in (1, 4, 16)] for op in gb.COLLECTIVE_OPS}
    ops["reduce_scatter"].append({"bytes": 64 * gb.MiB, "error": "RuntimeError: out of memory"})
    steps = {impl: 0.01 * (i + 1) for i, impl in enumerate(gb.IMPLS)}
    return {"device": "NVIDIA H100 80GB HBM3", "n_gpus": 2, "date": "2025-01-02", "torch": "2.13.0",
            "cuda": "12.8", "hardware": "CPU: x | GPU: 2 x NVIDIA H100 80GB HBM3",
            "tests": {"counts": {"passed": 5}}, "calibrate": {"error": "exited 2"},
            "collectives": {"world_size": 2, "backend": "nccl", "ops": ops},
            "training": {"models": {"tiny": {"median_step_s": steps}, "gpt2-small": {"error": "OOM"}}},
            "kernels": {"skipped": True}, "attention": {"skipped": True},
            "matmul": {"dtype": "bfloat16", "rows": [{"n": n, "seconds": 1e-3, "tflops": 100.0 * n / 1024}
                                                     for n in (1024, 2048, 4096)]},
            "mfu": {"mfu": 0.01, "tokens_per_s": 1e6}}


# --- without CUDA ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_main_without_cuda_says_so_returns_0_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_dir = tmp_path / "results"
    assert g.main(["--out-dir", str(out_dir), "--smoke", "--skip", "tests"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gpu-report: no CUDA device on this machine (CPU: ")
    assert lines[0].endswith("; nothing to report")
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_module_runs_as_a_command_and_exits_0_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even where there is one
    cmd = [sys.executable, "-m", "minitorch_dist.analysis.gpu_report", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device on this machine" in proc.stdout and "nothing to report" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_arguments():
    argv = ["--skip", "tests", "kernels", "--skip", "mfu", "--smoke", "--out-dir", "d"]
    args = g._parser().parse_args(argv)
    assert args.skip == ["tests", "kernels", "mfu"] and args.smoke and str(args.out_dir) == "d"
    default = g._parser().parse_args([])
    assert default.skip == [] and not default.smoke
    assert default.out_dir == g.ROOT / "notebooks" / "results" / "gpu"
    with pytest.raises(SystemExit) as e:
        g.main(["--skip", "everything"])
    assert e.value.code == 2


# --- naming and writing ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
                                        ("NVIDIA A100-SXM4-40GB", "nvidia-a100-sxm4-40gb"),
                                        ("  Tesla  T4 ", "tesla-t4"), ("???", "gpu")])
def test_gpu_slug(name, slug):
    assert g.gpu_slug(name) == slug


@pytest.mark.timeout(60)
def test_report_stem():
    assert g.report_stem("NVIDIA H200", 8, "2025-03-04") == "nvidia-h200-x8-2025-03-04"


@pytest.mark.timeout(60)
def test_writer_makes_the_json_and_one_png_per_plotted_section(tmp_path):
    result = _fake_result()
    paths = g.write_report(result, tmp_path / "gpu", "nvidia-h100-80gb-hbm3-x2-2025-01-02")
    names = sorted(p.name for p in paths)
    stem = "nvidia-h100-80gb-hbm3-x2-2025-01-02"
    assert names == sorted([f"{stem}.json", f"{stem}-busbw.png", f"{stem}-steps.png", f"{stem}-matmul.png"])
    for p in paths:
        assert p.exists() and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes().startswith(PNG)
    data = json.loads((tmp_path / "gpu" / f"{stem}.json").read_text())
    for key in ("device", "n_gpus", "date", "torch", "cuda", "hardware", *g.SECTIONS):
        assert key in data
    assert data["collectives"]["ops"]["all_reduce"][0]["busbw_GBps"] == 151.0
    assert "plot_errors" not in data


@pytest.mark.timeout(60)
def test_writer_skips_failed_sections_and_records_a_failed_plot(tmp_path):
    result = _fake_result()
    result["collectives"] = {"error": "RankError: rank 1 died"}
    result["matmul"] = {"skipped": True}
    result["training"] = {"models": {"tiny": {"median_step_s": {"ours_ddp": 1.0}}}}  # malformed
    paths = g.write_report(result, tmp_path, "stem")
    assert [p.name for p in paths] == ["stem.json"]
    data = json.loads((tmp_path / "stem.json").read_text())
    assert "KeyError" in data["plot_errors"]["training"]


# --- the sections, on CPU --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_collect_records_a_failing_section_and_runs_the_rest(tmp_path, monkeypatch):
    """The CUDA path of main with its sections faked: an error is recorded, later sections still run,
    skipped ones are marked, the JSON and PNGs are written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    fake = _fake_result()
    ran = []

    def section(name):
        def fn():
            ran.append(name)
            if name == "collectives":
                raise RuntimeError("NCCL error: unhandled system error")
            return dict(fake[name])
        return (fn,)

    monkeypatch.setattr(g, "_sections", lambda *a: {s: section(s) for s in g.SECTIONS})
    assert g.main(["--out-dir", str(tmp_path), "--skip", "kernels", "attention", "--skip", "tests"]) == 0
    assert ran == ["calibrate", "collectives", "training", "matmul", "mfu"]
    (path,) = tmp_path.glob("nvidia-h100-80gb-hbm3-x1-*.json")
    data = json.loads(path.read_text())
    assert data["collectives"]["error"] == "RuntimeError: NCCL error: unhandled system error"
    assert "Traceback" in data["collectives"]["traceback"]
    assert data["tests"] == {"skipped": True} and data["kernels"] == {"skipped": True}
    assert data["matmul"]["rows"] and data["n_gpus"] == 1 and "hardware" in data
    assert {p.name.removeprefix(path.stem) for p in tmp_path.glob("*.png")} == {"-steps.png", "-matmul.png"}


@pytest.mark.timeout(60)
def test_json_command_records_results_or_the_error(tmp_path):
    out = tmp_path / "r.json"
    ok = g.run_json_command(["-c", "import json, sys; json.dump({'a': 1}, open(sys.argv[1], 'w'))", str(out)],
                            out, 30)
    assert ok["returncode"] == 0 and ok["results"] == {"a": 1} and "error" not in ok
    bad = g.run_json_command(["-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "none.json", 30)
    assert bad["returncode"] == 3 and "boom" in bad["tail"] and "exited 3" in bad["error"]


@pytest.mark.timeout(60)
def test_gpu_tests_section_counts_the_summary(monkeypatch):
    out = "....s\n2 failed, 5 passed, 1 skipped, 1700 deselected in 12.3s\n"
    calls = []

    def fake(args, timeout_s):
        calls.append(args)
        return subprocess.CompletedProcess(args, 1, out, "")

    monkeypatch.setattr(g, "_subprocess", fake)
    res = g.run_gpu_tests()
    assert res["counts"] == {"failed": 2, "passed": 5, "skipped": 1} and "error" not in res
    assert calls[0][:5] == ["-m", "pytest", "-m", "gpu", "-q"]
    assert any(a.startswith("--ignore=") and a.endswith("test_gpu_report.py") for a in calls[0])


@pytest.mark.timeout(60)
def test_collective_sweep_on_cpu_ranks():
    (r0, _) = launch(gb.collectives_rank, 2, [gb.MiB // 4, gb.MiB], gb.COLLECTIVE_OPS, 1, 3, backend="gloo")
    assert r0["world_size"] == 2 and r0["backend"] == "gloo"
    # nccl-tests factors at n = 2: all-reduce 2(n-1)/n = 1, all-gather and reduce-scatter (n-1)/n = 1/2
    for op, factor in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
        rows = r0["ops"][op]
        assert [r["bytes"] for r in rows] == [gb.MiB // 4, gb.MiB]
        for r in rows:
            assert r["seconds"] > 0
            assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
            assert r["busbw_GBps"] == pytest.approx(factor * r["algbw_GBps"])


@pytest.mark.timeout(60)
def test_ours_vs_torch_step_times_on_cpu_ranks():
    cfg = vars(GPTConfig.tiny(block_size=16, n_embd=32))
    (r0, _) = launch(gb.training_rank, 2, cfg, 2, 1, backend="gloo")
    assert set(r0["median_step_s"]) == set(gb.IMPLS) and all(t > 0 for t in r0["median_step_s"].values())
    assert r0["ours_over_torch"]["ddp"] == pytest.approx(r0["median_step_s"]["ours_ddp"]
                                                         / r0["median_step_s"]["torch_ddp"])
    assert r0["world_size"] == 2 and r0["seq"] == 16


@pytest.mark.timeout(60)
def test_matmul_and_mfu_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    mm = gb.bench_matmul([32, 64], cpu, iters=2)
    assert [r["n"] for r in mm["rows"]] == [32, 64] and mm["dtype"] == "bfloat16"
    assert mm["rows"][1]["tflops"] == pytest.approx(2 * 64**3 / mm["rows"][1]["seconds"] / 1e12)
    unknown = gb.bench_mfu(cpu, "Some Other GPU", batch=2, steps=2)
    assert unknown["mfu"] is None and "no shipped profile" in unknown["peak_source"]
    assert unknown["tokens_per_s"] == pytest.approx(2 * 64 / unknown["step_s"])

    class Profile:
        peak_flops = {"bf16": 989e12}

    from minitorch_dist.analysis import profiles
    monkeypatch.setattr(profiles, "load_profile", lambda key: Profile if key == "h100" else None)
    known = gb.bench_mfu(cpu, "NVIDIA H100 80GB HBM3", batch=2, steps=2)
    assert known["peak_flops"] == 989e12
    assert known["mfu"] == pytest.approx(known["tokens_per_s"] * known["flops_per_token"] / 989e12)


@pytest.mark.timeout(60)
@pytest.mark.gpu
@pytest.mark.timeout(600)  # the smoke report: three launches under NCCL (spawned ranks), GEMMs, a GPT
def test_smoke_report_on_cuda(tmp_path):
    """The report itself, small: every section has an entry, and the measured ones have numbers. The
    gpu tests (this one among them), calibrate and the Triton benchmark are left out: they have their
    own tests, and the first would run this one again."""
    skip = ["tests", "calibrate", "kernels"]
    assert g.main(["--smoke", "--out-dir", str(tmp_path), "--skip", *skip]) == 0
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert data["n_gpus"] == torch.cuda.device_count() and data["cuda"]
    for section in g.SECTIONS:
        assert section in data, section
        assert (data[section] == {"skipped": True}) == (section in skip)
        assert "error" not in data[section], (section, data[section])
    assert all("median_step_s" in m for m in data["training"]["models"].values())
    assert data["matmul"]["rows"][-1]["tflops"] > 1
    assert data["mfu"]["tokens_per_s"] > 0
    assert list(tmp_path.glob("*-matmul.png"))
