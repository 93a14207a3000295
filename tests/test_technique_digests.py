"""Refactoring guard: the same seeds give *bitwise* the same parameters after a few steps of every
technique of :mod:`minitorch_dist.analysis.techniques` (DDP, ZeRO-1/2, fully_shard, TP, SP, the
pipeline schedules, EP and 3D), as recorded in ``tests/data/technique_digests.json``.

Why bitwise and not a tolerance: moving measurement code out of a technique, or reorganising its
buffers, must not change one floating-point operation; any change in order shows up as a different
SHA-256 of the parameters' bytes. Bitwise equality only holds on the machine that recorded the
digests, though: another CPU, another MKL code path (``MKL_CBWR``) or another torch rounds
differently -- and one CPU model name covers machines with and without AVX-512, whose kernels round
differently. So the file keeps one record per machine (:func:`machine`: the CPU's name, the vector
instructions its kernels use (AVX2 or AVX-512), the MKL path asked for, torch's version); the test runs
where a record matches and says why it skipped elsewhere. Record this machine with ``python
tests/test_technique_digests.py`` (a change *meant* to change the arithmetic re-records every machine it
can reach and drops the others; say so in the commit).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from minitorch_dist.analysis import techniques as T
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.timeout(600)

DIGESTS = Path(__file__).with_name("data") / "technique_digests.json"
STEPS = 3
CASES = [(t, 2) for t in T.TECHNIQUES] + [("3d", 4), ("tp", 4), ("zero3", 4)]


def machine() -> dict:
    """What decides the rounding: the CPU model and its vector instructions, the MKL code path asked for,
    torch's version."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(),
            "mkl_cbwr": os.environ.get("MKL_CBWR", ""), "torch": torch.__version__,
            "threads": os.environ.get("MTD_THREADS", "1")}


def _digest_rank(technique: str, world: int, steps: int) -> str:
    spec = T.make_step(technique, "tiny", world, seed=0)
    for _ in range(steps):
        spec.step()
    h = hashlib.sha256()
    for name, p in sorted(spec.model.state_dict().items()):
        if isinstance(p, torch.Tensor):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digests(technique: str, world: int, steps: int = STEPS) -> list[str]:
    """One SHA-256 per rank of the state after ``steps`` steps of ``technique`` on ``world`` ranks."""
    return launch(_digest_rank, world, technique, world, steps, timeout_s=300)


def _records() -> list[dict]:
    """Every machine's record: ``{"machine": ..., "steps": ..., "digests": {"ddp@2": [...], ...}}``."""
    return json.loads(DIGESTS.read_text())["records"] if DIGESTS.exists() else []


@pytest.mark.parametrize("technique, world", CASES, ids=[f"{t}@{n}" for t, n in CASES])
def test_parameters_are_bitwise_the_recorded_ones(technique, world):
    here = machine()
    rec = next((r for r in _records() if r["machine"] == here), None)
    if rec is None:
        pytest.skip(f"no digests recorded on a machine like this one ({here}), which rounds differently "
                    f"from {[r['machine'] for r in _records()]}: only the tolerance tests apply here")
    assert digests(technique, world) == rec["digests"][f"{technique}@{world}"]


def test_a_changed_operation_changes_the_digest():
    """The guard can fail: one step more is another digest (a change in arithmetic shows)."""
    a, b = digests("ddp", 2), digests("ddp", 2, STEPS + 1)
    assert a != b and a[0] == a[1]


if __name__ == "__main__":
    mine = {"machine": machine(), "steps": STEPS, "digests": {f"{t}@{n}": digests(t, n) for t, n in CASES}}
    others = [r for r in _records() if r["machine"] != mine["machine"]]
    DIGESTS.write_text(json.dumps({"records": others + [mine]}, indent=1) + "\n")
    print(f"recorded {len(CASES)} digests for this machine in {DIGESTS} "
          f"({len(others)} other machine(s) kept)", file=sys.stderr)
