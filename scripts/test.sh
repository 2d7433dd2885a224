#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
exec ${PYTHON:-python3} -m pytest -q -p no:cacheprovider tests "$@"
