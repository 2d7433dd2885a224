#!/usr/bin/env bash
# The GPU check: run from the repository root on a CUDA machine (no network needed):
#   bash scripts/device_check.sh
# Installs the carried flash-linear-attention wheels (.whl/*.whl, if any) into /tmp/site, prints the
# environment, builds the native I/O extension in place, then runs the CUDA tests together with the
# streaming and model tests (log also in $OUT/pytest.log when $OUT is set). Exits non-zero when the
# build or pytest fails. pytest is interrupted (SIGINT, so it still prints its summary) after
# $PYTEST_TIMEOUT seconds (default 210); setup before it takes well under a minute.
set -uo pipefail
cd "$(dirname "$0")/.."

export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PWD" \
        || echo "device_check: installing .whl/*.whl failed; continuing without them"
fi

echo "== environment"
nvidia-smi -L || echo "nvidia-smi: not available"
python3 - <<'EOF'
import os
import sys
import sysconfig

import torch
import transformers

print("python", sys.version.split()[0], "| Python.h:", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
print("torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
print("transformers", transformers.__version__)
for name in ("triton", "causal_conv1d"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:
        print(name, "not importable:", type(e).__name__, e)
try:
    import fla
    import fla.ops.gated_delta_rule  # noqa: F401  (what lean_qwenflash.models.kernels imports)
    print("fla", fla.__version__, "from", os.path.dirname(fla.__file__))
except Exception as e:
    print("fla not importable:", type(e).__name__, e)
EOF

echo "== build"
if ! python3 setup.py build_ext --inplace > /tmp/device_check_build.log 2>&1; then
    tail -n 40 /tmp/device_check_build.log
    echo "device_check: building the native extension failed (every test imports it)"
    exit 3
fi
grep "lean-qwenflash:" /tmp/device_check_build.log    # whether io_uring was built
python3 -c "from lean_qwenflash import io_engine; from lean_qwenflash.models import kernels
print('io_uring compiled:', io_engine.uring_compiled(), '| kernels use fla:', kernels._fla_chunk is not None,
      '| causal_conv1d:', kernels._cc1d_fn is not None)"

echo "== tests"
log="${OUT:+$OUT/pytest.log}"
timeout -s INT -k 20 "${PYTEST_TIMEOUT:-210}" \
    python3 -m pytest -q -rs -p no:cacheprovider --durations=15 \
    tests/test_cuda.py tests/test_tiered.py tests/test_models.py tests/test_quant_models.py 2>&1 | tee "${log:-/dev/null}"
rc=${PIPESTATUS[0]}
echo "device_check: pytest exit status $rc"
exit "$rc"
