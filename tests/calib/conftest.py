"""The calibration tests run a tiny model: its small matmuls are faster on one thread, and on a loaded
2-core machine torch's default of one thread per core made them ~20x slower (measured: calibrate w4a16 on
3.5k tokens, 1.4 s on one thread vs 32 s on two with the other core busy)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
