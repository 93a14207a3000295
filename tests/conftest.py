"""Suite-wide rules: `gpu` tests skip with a reason where there is no CUDA GPU; every test starts
from the same random state (torch, Python's `random`, NumPy seeded with 0), so a test that draws
unseeded numbers still sees the same ones whatever ran before it or alone."""
import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
