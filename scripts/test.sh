#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
. "$(dirname "$0")/_env.sh" test
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec python -m pytest "$@"
