import os
import sys

import torch

# Tests run against the working tree even before `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The test models are tiny: one thread is faster than two and immune to a busy second core.
torch.set_num_threads(1)
