#!/usr/bin/env bash
# One command on a CUDA GPU machine that reaches PyPI: verl's PPO trainer for 2 steps on the
# tiny Qwen3-Omni thinker through omni-train's verl hand-off (trainer.backend: verl). verl 0.9's
# rollout is a vLLM / SGLang server (it cannot run on a CPU, docs/scaling.md), so on top of the
# lock's verl fork this installs verl[vllm] (the vLLM and torch verl pins for it) into a
# separate environment. A few minutes with a warm uv cache.
#   bash benchmarks/device/verl_ppo_tiny.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
env_dir="${VERL_GPU_ENV:-$PWD/.nox/verl-gpu-env}"
UV_PROJECT_ENVIRONMENT="$env_dir" uv sync --locked --quiet --extra verl
uv pip install --python "$env_dir/bin/python" --quiet "verl[vllm]==0.9.1"
export HOME="${VERL_RUN_HOME:-$(mktemp -d)}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec timeout 280 "$env_dir/bin/python" -m pytest -m gpu -q -p no:cacheprovider \
    "packages/omni-train/tests/test_verl_backend.py::test_full_verl_run_on_tiny_thinker"
