import os
import sys

import pytest

# Tests run against the working tree even before `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lean_qwenflash  # noqa: E402,F401  (before torch, as users should: torch's idle OpenMP threads spin briefly)
import torch  # noqa: E402

# The test models are tiny: one thread is faster than two and immune to a busy second core.
torch.set_num_threads(1)


@pytest.fixture
def two_threads_split_everything(monkeypatch):
    """Decode's row-split products (kernels.linear) on every weight, as on a 2-core user machine
    (the suite otherwise runs one thread, where the split is off, and tiny weights stay under its
    size threshold). Shared by test_models and test_tiered."""
    # Imported here, not at the top: conftest loads for every test file, most never need the models.
    from lean_qwenflash.models import kernels, policy

    monkeypatch.setattr(kernels, "SPLIT_MIN_BYTES", 0)
    # The routed experts' torch path is the one that splits (the native kernels thread by themselves):
    # models built without a policy (load_hf_checkpoint) get exact kernels.
    monkeypatch.setattr(policy, "DEFAULT_POLICY", policy.ExecPolicy(kernel_mode="exact"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
