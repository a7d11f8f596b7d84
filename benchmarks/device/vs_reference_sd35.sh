#!/usr/bin/env bash
# One command on a CUDA GPU machine (written for one H200; nothing downloaded): our FlowGRPO
# step (omni-train's recipe -> make_ports -> DiffusionLoop) against the flow_grpo-style
# reference loop of benchmarks/vs_reference_loop.py, each side in its own process, on the
# full-size SD3.5-Medium transformer (the released config, 2.47B, omni_adapters.published)
# with random weights in bf16; text encoders of the released widths with 2 layers each,
# the released SD3 VAE. Prints the phase table (rollout, reward, update, step: seconds and
# reference / ours), the share outside the model, the transformer rows per step (equal
# work) and the peak GPU memory of each side's process; with $OUT set, also writes it to
# $OUT/vs_reference_sd35.txt. Extra arguments go to the benchmark (e.g. --repeats 3).
#
# Work: N = 8 samples (2 prompts x 4) of 512x512 (64x64 latents: 1024 image + 333 text
# tokens), 8 denoising steps, 7 trained timesteps, batch 8; 1 warm-up + 2 measured RL steps
# per process, 2 interleaved rounds (4 processes). Expected: about 3-4 minutes, under the 290 s
# timeout. Estimate: a transformer forward is at most 2 x 2.24e9 weights x 1357 tokens
# = 6 TFLOP per sample (each token meets only its stream's weights, so about half that); an RL
# step is 8 x 8 rollout forwards + 8 x 7 replayed forwards with their backward (about 2
# forwards) = 232 sample-forwards, at most 1.4 PFLOP, about 3.5 s at 400 TFLOP/s (half the
# H200's measured bf16 matmul rate); 3 steps + start-up and loading (~25 s) per process,
# x 4, plus the build (~30 s: random init on the GPU, 5.5 GB of safetensors written).
#
#   bash benchmarks/device/vs_reference_sd35.sh
#
# Environment: `uv sync --locked` (needs PyPI or a warm uv cache). On a machine that reaches
# nothing (the device tool's H200: python3 there has torch, transformers, peft, accelerate,
# but not diffusers, pydantic and the workspace's other pins), set VSREF_PYTHON to a Python
# that has the lock's packages, e.g. python3 with the missing ones carried as wheels
# (/work/.library/device/README.md: `.whl`, `pip install --target /tmp/site`, PYTHONPATH);
# the workspace's packages are then taken from packages/*/src:
#   run(command="... && VSREF_PYTHON=python3 bash benchmarks/device/vs_reference_sd35.sh",
#       carry=[".whl"], timeout_s=330)
# Status: not yet run (no GPU lent so far); docs/performance.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${VSREF_PYTHON:-}" ]]; then
    py="$VSREF_PYTHON"
    src=$(printf '%s:' "$PWD"/packages/*/src)
    export PYTHONPATH="${src}${PYTHONPATH:-}"
else
    uv sync --locked --quiet
    py="$PWD/.venv/bin/python"
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HOME="${VSREF_HOME:-$(mktemp -d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
log="${OUT:-$(mktemp -d)}/vs_reference_sd35.txt"
timeout 290 "$py" benchmarks/vs_reference_loop.py \
    --models sd35-medium --device cuda --dtype bfloat16 \
    --size 512 --prompts 2 --n 4 --num-steps 8 --batch 8 \
    --warmup 1 --steps 2 --repeats 2 "$@" 2>&1 | tee "$log"
