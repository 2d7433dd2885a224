"""Build and install lean-qwenflash.

The native extension (csrc/, plain C++17 + pybind11, no torch headers) is always built with the
pread engine; the io_uring engine is added when pkg-config finds liburing.
"""
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext

# Compile the C++ files in parallel, one job per core (LQF_BUILD_JOBS=N to choose): the kernels'
# files take most of a fresh install's time, and a first run waits for them.
ParallelCompile("LQF_BUILD_JOBS", default=0).install()


def liburing_flags():
    if shutil.which("pkg-config"):
        try:
            cflags = subprocess.check_output(["pkg-config", "--cflags", "liburing"], text=True).split()
            libs = subprocess.check_output(["pkg-config", "--libs", "liburing"], text=True).split()
            return cflags, libs
        except subprocess.CalledProcessError:
            pass
    return None


uring = liburing_flags()
macros = []
extra_compile = ["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"]
extra_link = ["-pthread"]
if uring:
    macros.append(("LQF_HAVE_URING", "1"))
    extra_compile += uring[0]
    extra_link += uring[1]
    print("lean-qwenflash: building with liburing (io_uring engine + pread engine)", file=sys.stderr)
else:
    print("lean-qwenflash: liburing NOT found by pkg-config; building the pread engine only "
          "(install liburing-dev and rebuild for io_uring)", file=sys.stderr)

ext = Pybind11Extension(
    "lean_qwenflash._io",
    sources=["csrc/io_engine.cpp", "csrc/uring_backend.cpp", "csrc/slot_table.cpp", "csrc/bindings.cpp"],
    define_macros=macros,
    extra_compile_args=extra_compile,
    extra_link_args=extra_link,
    cxx_std=17,
)

# CPU kernels (csrc/quant*.cpp, moe.cpp): the AVX2 and AVX-512 files select their ISA per function
# (#pragma GCC target) and run only after a run-time CPU check; the rest is baseline x86-64.
# -ffp-contract=off keeps exact dequantization bit-equal to numpy's (no fused multiply-adds).
kernels = Pybind11Extension(
    "lean_qwenflash._kernels",
    sources=["csrc/quant_scalar.cpp", "csrc/quant_types.cpp", "csrc/quant_avx2.cpp", "csrc/quant_avx512.cpp", "csrc/moe.cpp",
             "csrc/affinity.cpp", "csrc/ops.cpp", "csrc/attention.cpp", "csrc/decode_step.cpp", "csrc/deltanet.cpp", "csrc/kernels_bindings.cpp"],
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-ffp-contract=off"],
    extra_link_args=["-pthread", "-ldl"],
    cxx_std=17,
)

setup(
    name="lean-qwenflash",
    version="0.1.0",
    description="Run Mixture-of-Experts LLMs larger than memory by streaming experts from NVMe",
    packages=find_packages(include=["lean_qwenflash", "lean_qwenflash.*"]),
    package_data={"lean_qwenflash": ["default_model/*", "default_model/**/*", "server/ui/*"]},
    include_package_data=True,
    ext_modules=[ext, kernels],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first by scripts/setup.sh (a bare requirement would pull a CUDA build)
        "torch>=2.1",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "pyyaml>=6",
        "tqdm>=4.60",
        "numpy>=1.24",
        "jinja2>=3.1",
        "gguf>=0.17",          # GGUF import (`pack MODEL.gguf`)
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "prometheus-client>=0.17",
        "llguidance>=1.0",     # grammar-constrained tool calls and JSON answers (server)
        "huggingface_hub>=0.30",   # `pull`: downloads from the Hub (resumable, its cache)
    ],
    extras_require={
        "dev": ["pytest>=7", "gguf>=0.17", "llama-cpp-python>=0.3.30", "transformers>=5.0", "openai>=1.30", "anthropic>=0.42", "httpx>=0.27", "jsonschema>=4", "schemathesis>=3.30", "litellm>=1.50"],
        "cuda": ["flash-linear-attention", "causal-conv1d", "flash-attn"],
        "exl3": ["exllamav3"],
    },
    entry_points={"console_scripts": ["lean-qwenflash=lean_qwenflash.cli:main"]},
)
