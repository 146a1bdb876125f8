import os

import pytest
import torch

# Two cores on CI; keep torch from oversubscribing when tests spawn processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
