"""lean-qwenflash: run Mixture-of-Experts LLMs larger than memory by streaming routed experts
from a packed store on NVMe through a host (and, with CUDA, a device) expert cache."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# torch's intra-op threads are GNU OpenMP's, which reads its wait settings once, when torch loads.
# Unset, an idle OpenMP thread spins 300000 pauses (~10 ms on recent x86) before it sleeps: beside
# our native pool and a busy neighbour process those spins hold the core a preempted thread needs,
# at every parallel region, and a long prompt of a hybrid model ran at 0.13-0.26x its idle speed.
# 3000 pauses (~0.2 ms) kept the idle speed and gave 0.61-0.66x (OMP_WAIT_POLICY=PASSIVE, no spin:
# 0.71-0.76x, but 5-8% slower idle; docs/DESIGN.md, "Expert kernels"). So unless the user set
# either, GOMP_SPINCOUNT is ours: this has to run before torch is imported. ``TORCH_OMP_WAIT`` says
# what torch's threads got: None when torch was loaded first with neither set (they spin long;
# ``doctor`` and ``Runtime.open`` say so); ``TORCH_OMP_WAIT_OURS`` whether it is our setting.
OMP_SPIN_COUNT = "3000"
_chosen = [f"{k}={_os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in _os.environ]
TORCH_OMP_WAIT_OURS = not _chosen and "torch" not in _sys.modules
if TORCH_OMP_WAIT_OURS:
    _os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    TORCH_OMP_WAIT = f"GOMP_SPINCOUNT={OMP_SPIN_COUNT}"
else:
    TORCH_OMP_WAIT = ", ".join(_chosen) or None
