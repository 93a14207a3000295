"""Suite-wide rules: `gpu` tests skip with a reason where there is no CUDA GPU; every test starts
from the same random state (torch, Python's `random`, NumPy seeded with 0), so a test that draws
unseeded numbers still sees the same ones whatever ran before it or alone; tests timed against a
prediction or a limit are marked ``serial`` (``make test`` runs them after the rest: alone, or two
at a time where they hold a deadline with room to spare); tests whose floating-point
results depend on the CPU's rounding are marked ``numerics`` (run again under another MKL code path by
``.ci/run``); and the report's header
says which implementation the exercise tests load (your stubs or the worked solutions)."""
import os
import random

import numpy as np
import pytest
import torch
from _passes import DEADLINE_FILES, NUMERICS_FILES, SERIAL_FILES, WORLD_PARAM  # which files each pass runs


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES | DEADLINE_FILES:
            item.add_marker(pytest.mark.serial)
        if item.path.name in NUMERICS_FILES:
            item.add_marker(pytest.mark.numerics)
        param, callspec = WORLD_PARAM.get(item.path.name), getattr(item, "callspec", None)
        if param and callspec and callspec.params.get(param, 2) > 2:
            item.add_marker(pytest.mark.wide)  # the portability pass leaves it to the main pass
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
