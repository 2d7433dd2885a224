"""lean-qwenflash: run Mixture-of-Experts LLMs larger than memory by streaming routed experts
from a packed store on NVMe through a host (and, with CUDA, a device) expert cache."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# torch's intra-op threads are GNU OpenMP's, which reads its wait settings once, when torch loads.
# Unset, an idle OpenMP thread spins 300000 pauses (~10 ms on recent x86) before it sleeps: beside
# our native pool and a busy neighbour process those spins hold the core a preempted thread needs,
# at every parallel region, and a long prompt of a hybrid model ran at 0.13-0.26x its idle speed.
# With threads free to move, 3000 pauses (~0.2 ms) kept the idle speed and gave 0.61-0.66x
# (OMP_WAIT_POLICY=PASSIVE, no spin: 0.71-0.76x, but 5-8% slower idle; docs/DESIGN.md, "Expert
# kernels"). With each compute thread bound to a core of its own (models/affinity.py, the default
# when the thread budget is every core), a longer spin keeps torch's worker awake between regions,
# so a neighbour gets no wake-up to take the core at: 30000 pauses took a hybrid 512-token prompt
# beside a nice-19 loop from 0.89 to 0.96x of idle and idle 3% faster, beside a nice-0 loop no worse;
# unbound, 30000 cost a third of the speed beside nice 0. So unless the user set either variable,
# GOMP_SPINCOUNT is ours, chosen by whether the default policy binds; this has to run before torch is
# imported. ``TORCH_OMP_WAIT`` says what torch's threads got: None when torch was loaded first with
# neither set (they spin long; ``doctor`` and ``Runtime.open`` say so); ``TORCH_OMP_WAIT_OURS``
# whether it is our setting.
OMP_SPIN_UNBOUND = "3000"
OMP_SPIN_BOUND = "30000"


def binds_by_default() -> bool:
    """Whether ``cpu_bind: auto`` with the default thread budget binds threads in this process:
    two or more CPUs in its affinity mask and no cgroup CPU quota below them (the rule of
    ``models.affinity.choose_cpus`` with ``policy.available_cpus``, without importing torch)."""
    from ._host import cgroup_cpu_limit
    try:
        cores = len(_os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return False
    limit = cgroup_cpu_limit()
    return cores >= 2 and (limit is None or int(limit) >= cores)


OMP_SPIN_COUNT = OMP_SPIN_BOUND if binds_by_default() else OMP_SPIN_UNBOUND
_chosen = [f"{k}={_os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in _os.environ]
TORCH_OMP_WAIT_OURS = not _chosen and "torch" not in _sys.modules
if TORCH_OMP_WAIT_OURS:
    _os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    TORCH_OMP_WAIT = f"GOMP_SPINCOUNT={OMP_SPIN_COUNT}"
else:
    TORCH_OMP_WAIT = ", ".join(_chosen) or None
