#!/usr/bin/env bash
# Build (or reuse) the project's dev/test virtualenv and link it at ./.venv.
#
# The venv holds dependencies only (the checkout is put on sys.path by pytest and
# `python -m app`), so one built venv serves every clone on this machine. It lives
# in a cache folder keyed by the hash of the requirement files: CI on the same
# machine reuses it, a fresh machine builds it (~1.5 min, ~2.5 GB with vLLM).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
key=$(cat requirements/server.txt requirements/dev.txt requirements/vllm.txt scripts/bootstrap_venv.sh | sha256sum | cut -c1-16)
cache=${MPCACHE_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mpcache}
venv="$cache/venv-$key"

if [ ! -f "$venv/.complete" ]; then
    echo "bootstrap: building $venv" >&2
    # Built in place (venvs are not relocatable); .complete marks a finished build.
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    pip="$venv/bin/python -m pip"
    # The CPU torch first, exactly pinned, so nothing later can pull a CUDA build.
    $pip install -q torch==2.13.0
    $pip install -q -r requirements/dev.txt
    # vLLM's classes for the connector tests (docs/design.md s.6): no deps, CPU torch kept.
    $pip install -q --no-deps vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
        "llguidance>=1.7.0,<1.8.0"
    $pip install -q -r requirements/vllm.txt -c requirements/dev.txt
    "$venv/bin/python" -c "import torch, fastapi, fastapi_offline, vllm; assert torch.__version__.startswith('2.13.0')"
    touch "$venv/.complete"
fi
if [ "$(readlink .venv 2>/dev/null || true)" != "$venv" ]; then
    rm -rf .venv
    ln -s "$venv" .venv
fi
