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
from dataclasses import dataclass
from typing import Optional

import torch

from ..common import EXPERT_KERNELS, KERNEL_ISAS

# Idle-worker spin (pause instructions) of the native pool during a CPU decode step, where torch
# runs on one thread and the kernels are called ~100 times per step (csrc/moe.cpp).
DECODE_SPIN = 100000
ALIGNMENT = 4096          # workspace buffers start on a page, as store records do


@dataclass(frozen=True)
class ExecPolicy:
    """What a model's kernels do (see ``models.kernels``).

    * ``kernel_mode``: ``fast`` (native kernels read encoded rows, int8 activations) or ``exact``
      (dequantize exactly, then torch) for routed experts and quantized resident matrices;
    * ``float_native``: one-row products with large float weights also take the native kernel;
    * ``isa``: force a native path (auto, scalar, avx2, avx512);
    * ``native_threads``: threads of the native kernels (0: torch's intra-op count at each call);
    * ``decode_torch_threads``: torch's intra-op threads during one-token CPU steps (None: leave
      torch's setting), with the native pool's idle spin set to ``decode_spin`` meanwhile.
    """

    kernel_mode: str = "fast"
    float_native: bool = False
    isa: str = "auto"
    native_threads: int = 0
    decode_torch_threads: Optional[int] = None
    decode_spin: int = DECODE_SPIN

    def __post_init__(self):
        if self.kernel_mode not in EXPERT_KERNELS or self.isa not in KERNEL_ISAS:
            raise ValueError(f"expert kernels must be one of {EXPERT_KERNELS} and isa one of {KERNEL_ISAS}; "
                             f"got {self.kernel_mode!r}, {self.isa!r}")
        if self.native_threads < 0 or (self.decode_torch_threads is not None and self.decode_torch_threads < 1):
            raise ValueError(f"native_threads must be >= 0 and decode_torch_threads >= 1 or None; got "
                             f"{self.native_threads}, {self.decode_torch_threads}")

    @classmethod
    def from_config(cls, cfg) -> "ExecPolicy":
        """The policy a runtime config asks for (``expert_kernels``, ``cpu_isa``, ``cpu_threads``,
        ``device``). On CPU in fast mode one-token steps run torch on one thread and the native
        kernels on ``cpu_threads`` (default: torch's intra-op count now): torch's small per-token
        ops are faster on one thread than fighting the kernels for the cores."""
        fast_cpu = cfg.device == "cpu" and cfg.expert_kernels == "fast"
        return cls(kernel_mode=cfg.expert_kernels, float_native=cfg.expert_kernels == "fast", isa=cfg.cpu_isa,
                   native_threads=cfg.cpu_threads or (torch.get_num_threads() if fast_cpu else 0),
                   decode_torch_threads=1 if fast_cpu else None)

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
