#!/usr/bin/env bash
# Set up (if needed) and run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec ${PYTHON:-python3} scripts/demo_pack.py "$@"
