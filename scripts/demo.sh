#!/usr/bin/env bash
# Set up .venv (if needed) and serve the default model.
set -euo pipefail
. "$(dirname "$0")/_env.sh" demo
exec shard-coord serve --local-nodes 3 "$@"
