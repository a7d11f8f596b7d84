#!/usr/bin/env bash
# One command on a CUDA GPU machine that reaches PyPI: the tiny SD3 through the real vllm-omni
# engine (vllm-omni 0.30 + vLLM 0.30, the lock's vllm-omni fork) against the embedded engine,
# before and after a LoRA weight sync. Under 5 minutes with a warm uv cache (the environment
# sync is the long part the first time). Exits non-zero when the trajectories differ by more
# than --tol (default 1e-3).
#   bash benchmarks/device/vllm_omni_parity.sh [--requests 16] [--tol 1e-3]
set -euo pipefail
cd "$(dirname "$0")/../.."
env_dir="${VLLM_OMNI_ENV:-$PWD/.nox/vllm-omni-env}"
UV_PROJECT_ENVIRONMENT="$env_dir" uv sync --locked --quiet --extra vllm-omni
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec timeout 280 "$env_dir/bin/python" benchmarks/device/vllm_omni_parity.py "$@"
