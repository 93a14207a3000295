"""Chapter 00 — the shipped machine profiles (h100, h200, a100): they load, every number is cited, and the
rates are physically possible (no GEMM faster than the dense datasheet peak).

Tolerances: the profiles' numbers are read back from JSON or fitted by a few float64 operations on
them; pytest.approx's default rel 1e-6 is far above that rounding and far below the gaps it tells
apart (989e12 against the sparsity figure 1979e12)."""
import json
import math

import pytest

from minitorch_dist.analysis.profiles import COLLECTIVES, SHIPPED, load_profile, monotone, shipped_path

pytestmark = pytest.mark.ch00

#: FLOP counts the GEMM table is read at: table points plus a log grid well past both ends.
_GRID = [10 ** (e / 8) for e in range(5 * 8, 15 * 8 + 1)]


def _numeric(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    if isinstance(v, dict):
        return any(_numeric(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_numeric(x) for x in v)
    return False


@pytest.fixture(params=SHIPPED)
def profile(request):
    return load_profile(request.param)


def test_shipped_profiles_load(profile):
    assert profile.kind == "shipped"
    assert profile.name in SHIPPED
    assert profile.world_size == 8 and profile.gpus_per_node == 8 and profile.threads_per_rank == 1
    assert profile.memory_bytes > 1e10
    assert profile.hardware and profile.device and profile.created
    assert set(profile.collectives) == set(COLLECTIVES)
    for op in COLLECTIVES:
        alpha, beta = profile.alpha_beta(op)
        assert alpha > 0 and beta > 0
    assert 0.0 <= profile.overlap <= 1.0
    assert profile.inter_node["alpha_s"] > 0 and profile.inter_node["beta_s_per_byte"] > 0
    assert load_profile(profile.name.upper()).name == profile.name  # names are case-insensitive


def test_every_number_is_cited(profile):
    data = json.loads(shipped_path(profile.name).read_text())
    sources = data["sources"]
    assert all(isinstance(s, str) and len(s) > 20 for s in sources.values())
    numeric = [k for k, v in data.items() if k not in ("sources", "notes") and _numeric(v)]
    assert {"memory_bytes", "peak_flops", "matmul", "collectives", "overlap", "inter_node"} <= set(numeric)
    for key in numeric:
        assert any(s == key or s.startswith(key + ".") for s in sources), f"{profile.name}: {key} uncited"
    for op in COLLECTIVES:
        assert f"collectives.{op}" in sources, f"{profile.name}: collectives.{op} uncited"
    for dtype in data["peak_flops"]:
        assert f"peak_flops.{dtype}" in sources
    for dtype in data["matmul"]:
        assert f"matmul.{dtype}" in sources
    assert data["notes"] and all(isinstance(n, str) for n in data["notes"])


def test_h100_bf16_peak_is_dense():
    h100 = load_profile("h100")
    assert h100.peak_flops["bf16"] == pytest.approx(989e12)
    assert h100.peak_flops["bf16"] != pytest.approx(1979e12)  # the "with sparsity" figure
    assert h100.peak_flops["fp8"] == pytest.approx(1979e12)
    assert "fp8" not in load_profile("a100").peak_flops  # Ampere has no fp8 tensor cores


def test_matmul_tables_monotone_and_below_peak(profile):
    for dtype, table in profile.matmul.items():
        assert len(table) >= 4
        flops = [f for f, _ in table]
        secs = [t for _, t in table]
        assert flops == sorted(flops) and len(set(flops)) == len(flops)
        assert all(t1 > t0 for t0, t1 in zip(secs, secs[1:])), f"{profile.name} {dtype}: time not increasing"
        assert flops[0] <= 2e9 and flops[-1] >= 1e13  # spans ~1e9 .. ~1e13 FLOPs per GEMM
        peak = profile.peak_flops[dtype]
        points = sorted(set(flops) | set(_GRID))
        times = [profile.matmul_seconds(f, dtype) for f in points]
        assert all(t1 >= t0 for t0, t1 in zip(times, times[1:])), f"{profile.name} {dtype}: not monotone"
        for f, t in zip(points, times):
            assert t > 0 and math.isfinite(t)
            assert f / t <= peak * (1 + 1e-9), f"{profile.name} {dtype}: {f:.3g} FLOPs at {f / t:.4g} FLOP/s"


def test_nvlink_all_reduce_bus_bandwidth(profile):
    _, beta = profile.alpha_beta("all_reduce")
    assert 100e9 <= 1 / beta <= 1000e9  # nccl-tests busbw of 8 GPUs on NVLink / NVSwitch


def test_h200_has_more_memory_and_bandwidth_than_h100():
    h100, h200 = load_profile("h100"), load_profile("h200")
    assert h200.memory_bytes > h100.memory_bytes
    assert h200.copy_bytes_per_s > h100.copy_bytes_per_s
    assert h200.peak_flops == h100.peak_flops  # same GH100 compute


def test_profile_missing_a_key_is_refused(tmp_path):
    data = json.loads(shipped_path("h100").read_text())
    del data["overlap"]
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="overlap"):
        load_profile(path)


BAD_RATES = [  # (where in the file, the value written there, the field the error names)
    (("op_overhead_s",), -7e-6, "op_overhead_s"),
    (("copy_bytes_per_s",), 0.0, "copy_bytes_per_s"),
    (("collectives", "all_reduce", "beta_s_per_byte"), float("nan"),
     "collectives.all_reduce.beta_s_per_byte"),
    (("peak_flops", "bf16"), float("inf"), "peak_flops.bf16"),
    (("matmul", "fp32", 1, 1), -0.000787, "matmul.fp32[1][1]"),
    (("inter_node", "alpha_s"), "5us", "inter_node.alpha_s"),
    (("overlap",), 1.5, "overlap"),
]


@pytest.mark.parametrize("keys, value, field", BAD_RATES, ids=[f for _, _, f in BAD_RATES])
def test_a_profile_with_an_impossible_rate_is_refused_naming_the_field_and_file(keys, value, field, tmp_path):
    """A negative, zero, NaN or infinite rate would give negative step times, or NaN that a sum or a
    minimum silently drops: refused when the profile is loaded."""
    data = json.loads(shipped_path("h100").read_text())
    where = data
    for k in keys[:-1]:
        where = where[k]
    where[keys[-1]] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))  # NaN and Infinity as JSON's extensions, which Python reads back
    with pytest.raises(ValueError, match="recalibrate|Recalibrate") as err:
        load_profile(path)
    assert f"profile {path}: {field} is " in str(err.value)


def test_commands_refuse_a_profile_with_an_impossible_rate(tmp_path, capsys):
    """``predict`` printed negative step times and ``plan`` a table of nan from such a profile."""
    from minitorch_dist.__main__ import main

    data = json.loads(shipped_path("h100").read_text())
    data["collectives"]["all_reduce"]["beta_s_per_byte"] = float("nan")
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(data))
    for argv in (["predict", "--technique", "ddp", "--profile", str(path)],
                 ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--profile", str(path)]):
        assert main(argv) == 2
        out = capsys.readouterr()
        assert "collectives.all_reduce.beta_s_per_byte is nan" in out.err and "nan s" not in out.out


@pytest.mark.parametrize("which", ["v100", "no/such/profile.json"])
def test_unknown_profile_points_to_calibrate(which):
    with pytest.raises(ValueError, match="calibrate"):
        load_profile(which)


def test_missing_calibrated_profile_points_to_calibrate(tmp_path, monkeypatch):
    monkeypatch.setenv("MTD_PROFILE", str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="calibrate"):
        load_profile(None)


def test_a_swept_curve_never_falls_with_size():
    """A busy machine's means can dip (a 128 kB all-to-all measured faster than a 4 kB one); the profile
    pools such runs into their mean (least squares under "never faster for more bytes")."""
    rising = [[1e3, 1e-4], [1e4, 2e-4], [1e5, 5e-4]]
    assert monotone(rising) == rising
    dipped = [[4e3, 9e-4], [3e4, 5e-4], [1.3e5, 1e-4], [1e6, 2e-3]]
    fit = monotone(dipped)
    assert [t for _, t in fit] == pytest.approx([5e-4, 5e-4, 5e-4, 2e-3])  # the first three pooled
    assert all(a[1] <= b[1] for a, b in zip(fit, fit[1:]))
    p = load_profile("h100")
    p.collective_sweeps = {"all_to_all": dipped}
    p.world_size = 2
    assert p.swept_seconds("all_to_all", 1.3e5, 2) == pytest.approx(5e-4)
