"""How a model computes: its execution policy, and the per-model context that carries it.

``ExecPolicy`` is one immutable value decided once (``from_config``, from the runtime config and
the machine): the kernel mode for quantized and routed-expert math, the native ISA, the threads of
the native kernels and of torch during one-token steps, and how long idle native threads spin
while such a step runs. A model holds one ``ExecContext`` (its policy plus its ``Workspace`` of
reused buffers); every module that reads the policy holds a reference to that same context, so
changing a model's policy is one assignment, two models in one process never share scratch
buffers, and a policy never leaks from one model into another.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .. import OMP_SPIN_BOUND, OMP_SPIN_COUNT, OMP_SPIN_UNBOUND, TORCH_OMP_WAIT, TORCH_OMP_WAIT_OURS
from .._host import cgroup_cpu_limit
from ..common import EXPERT_KERNELS, KERNEL_ISAS, KV_CACHE_DTYPES
from .affinity import choose_cpus

# Idle-worker spin (pause instructions) of the native pool during a CPU decode step, where torch
# runs on one thread and the kernels are called ~100 times per step (csrc/moe.cpp).
DECODE_SPIN = 100000
ALIGNMENT = 4096          # workspace buffers start on a page, as store records do


def torch_threads_spin() -> Optional[str]:
    """Why torch's idle OpenMP threads spin long in this process (None: they spin briefly, or the
    user chose). ``lean_qwenflash/__init__.py`` sets that up when it is imported before torch."""
    if TORCH_OMP_WAIT is not None:
        return None
    return ("torch was imported before lean_qwenflash with neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY "
            "set, so its idle threads spin ~10 ms each time: beside another busy process a long prompt "
            "ran 2-5x slower. Import lean_qwenflash before torch, or set "
            f"GOMP_SPINCOUNT={OMP_SPIN_COUNT} in the environment")


def torch_spin_unbound(policy: "ExecPolicy") -> Optional[str]:
    """What to do when this process chose torch's long OpenMP spin for bound threads (the default
    policy binds here) but ``policy`` leaves its threads unbound (None otherwise)."""
    if not (TORCH_OMP_WAIT_OURS and OMP_SPIN_COUNT == OMP_SPIN_BOUND) or policy.bind_cpus:
        return None
    if not policy.torch_threads or policy.torch_threads < 2:
        return None
    return (f"torch's OpenMP threads spin {OMP_SPIN_BOUND} pauses (~2 ms) before sleeping, chosen for compute "
            f"threads bound one per core, but this config leaves them unbound (cpu_bind: off, or cpu_threads "
            f"below this machine's cores): beside a busy process a long prompt ran ~1/3 slower that way. Use "
            f"cpu_bind: on, or set GOMP_SPINCOUNT={OMP_SPIN_UNBOUND} in the environment")


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return max(1, cores)


@dataclass(frozen=True)
class ExecPolicy:
    """What a model's kernels do (see ``models.kernels``).

    * ``kernel_mode``: ``fast`` (native kernels read encoded rows, int8 activations) or ``exact``
      (dequantize exactly, then torch) for routed experts and quantized resident matrices;
    * ``float_native``: one-row products with large float weights also take the native kernel;
    * ``isa``: force a native path (auto, scalar, avx2, avx512);
    * ``native_threads``: threads of the native kernels (0: torch's intra-op count at each call);
    * ``torch_threads``: torch's intra-op threads for many-token steps (prefill) on CPU (None:
      leave torch's setting);
    * ``decode_torch_threads``: torch's intra-op threads during one-token CPU steps (None: leave
      torch's setting), with the native pool's idle spin set to ``decode_spin`` meanwhile;
    * ``kv_cache_dtype``: how attention layers store keys and values (f32 as computed, f16, bf16, or
      GGUF's q8_0 / q4_0 blocks dequantized inside attention; see ``layers.attention``);
    * ``stored_floats``: resident f16 / bf16 matrices narrower than the compute dtype keep their
      stored encoding (``loader.build_model``) and run like encoded ones (native kernels with fp32
      activations in fast mode, exact conversion then torch otherwise): half the memory and the
      bytes read per token of an fp32 copy.
    * ``bind_cpus``: CPUs the compute threads of a CPU step are bound to, one per thread (``()``:
      none; ``models.affinity``): the calling thread to the first, native and torch worker i to
      the i-th.

    The thread counts are one budget (``from_config``): torch and the native kernels take turns on
    the same cores, never more threads than the cores this process may use.
    """

    kernel_mode: str = "fast"
    float_native: bool = False
    isa: str = "auto"
    native_threads: int = 0
    torch_threads: Optional[int] = None
    decode_torch_threads: Optional[int] = None
    decode_spin: int = DECODE_SPIN
    kv_cache_dtype: str = "f32"
    stored_floats: bool = False
    bind_cpus: tuple = ()

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {self.kv_cache_dtype!r}")
        if self.kernel_mode not in EXPERT_KERNELS or self.isa not in KERNEL_ISAS:
            raise ValueError(f"expert kernels must be one of {EXPERT_KERNELS} and isa one of {KERNEL_ISAS}; "
                             f"got {self.kernel_mode!r}, {self.isa!r}")
        if any(not isinstance(c, int) or c < 0 for c in self.bind_cpus) or len(set(self.bind_cpus)) != len(self.bind_cpus):
            raise ValueError(f"bind_cpus must be distinct CPU numbers; got {self.bind_cpus!r}")
        if self.native_threads < 0 or any(t is not None and t < 1 for t in (self.torch_threads, self.decode_torch_threads)):
            raise ValueError(f"native_threads must be >= 0, torch_threads and decode_torch_threads >= 1 or None; got "
                             f"{self.native_threads}, {self.torch_threads}, {self.decode_torch_threads}")

    @classmethod
    def from_config(cls, cfg) -> "ExecPolicy":
        """The policy a runtime config asks for (``expert_kernels``, ``cpu_isa``, ``cpu_threads``,
        ``device``, ``kv_cache_dtype``). One thread budget on CPU: ``cpu_threads``, or the cores this
        process may use (``available_cpus``: affinity and cgroup quota), for torch's many-token work and for the
        native kernels alike. In fast mode one-token steps run torch on one thread and the native
        kernels on the budget: torch's small per-token ops are faster on one thread than fighting
        the kernels for the cores. ``cpu_bind`` binds each of the budget's threads to a core of its
        own (``affinity.choose_cpus``)."""
        cpu = cfg.device == "cpu"
        budget = cfg.cpu_threads or available_cpus()
        fast_cpu = cpu and cfg.expert_kernels == "fast"
        return cls(kernel_mode=cfg.expert_kernels, float_native=cfg.expert_kernels == "fast", isa=cfg.cpu_isa,
                   native_threads=budget if cpu else cfg.cpu_threads, torch_threads=budget if cpu else None,
                   decode_torch_threads=1 if fast_cpu else None, kv_cache_dtype=cfg.kv_cache_dtype,
                   stored_floats=fast_cpu, bind_cpus=choose_cpus(cfg.cpu_bind, budget) if cpu else ())

    def with_kernels(self, mode: str, isa: Optional[str] = None) -> "ExecPolicy":
        """This policy with another kernel mode (float linears follow it) and optionally ISA."""
        return dataclasses.replace(self, kernel_mode=mode, float_native=mode == "fast", isa=isa or self.isa)


class Workspace:
    """Buffers reused across calls, one per (role, shape): dequantized weights land in the same
    fp32 buffer every time (BLAS picks code paths by pointer alignment, so resident and streamed
    experts must be dequantized to the same place to give the same bits), and no call allocates."""

    def __init__(self):
        self._buffers: dict = {}

    def buffer(self, role: str, shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = (role, tuple(shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:   # page-aligned, like the records: every workspace gives BLAS the same alignment
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
            start = (-raw.data_ptr()) % ALIGNMENT
            buf = self._buffers[key] = raw[start:start + nbytes].view(dtype).view(shape)
        return buf

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


# A new model's policy until it is given one (``CausalLM.set_policy``; ``Runtime`` always does).
DEFAULT_POLICY = ExecPolicy()


class ExecContext:
    """A model's policy and workspace; modules that compute hold a reference to their model's one."""

    __slots__ = ("policy", "workspace")

    def __init__(self, policy: Optional[ExecPolicy] = None):
        self.policy = policy or DEFAULT_POLICY
        self.workspace = Workspace()


# The context of modules used outside a model (tests building one layer); CausalLM gives each
# model its own.
STANDALONE = ExecContext()
