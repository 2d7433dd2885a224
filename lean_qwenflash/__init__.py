"""lean-qwenflash: run Mixture-of-Experts LLMs larger than memory by streaming routed experts
from a packed store on NVMe through a host (and, with CUDA, a device) expert cache."""

__version__ = "0.1.0"
