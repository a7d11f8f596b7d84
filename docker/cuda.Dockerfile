# syntax=docker/dockerfile:1
# omni-rl for NVIDIA GPUs: the workspace environment of uv.lock (every package, the CPU-capable
# extras), installed non-editable. Build from the repository root:
#
#   docker build -f docker/cuda.Dockerfile -t omni-rl:cuda .
#   docker run --gpus all --rm -it -v "$PWD/runs:/workspace/runs" omni-rl:cuda \
#       omni-train recipes/quickstart.yaml
#
# torch comes from uv.lock as PyPI's Linux wheel, which carries its own CUDA 13 runtime
# (the nvidia-* wheels), so the base needs no CUDA toolkit: only the host's NVIDIA driver
# (>= 580 for CUDA 13), which the NVIDIA Container Toolkit mounts at `docker run --gpus`.
# docs/install.md has the details and the Ascend NPU image.

ARG PYTHON_VERSION=3.11
ARG UV_VERSION=0.13.9

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM python:${PYTHON_VERSION}-slim-bookworm

COPY --from=uv /uv /uvx /usr/local/bin/

ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/opt/omni-rl \
    PATH=/opt/omni-rl/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /src/omni-rl

# The lock and the package sources; recipes/ too, since the omni-train wheel carries it.
COPY pyproject.toml uv.lock README.md ./
COPY packages ./packages
COPY recipes ./recipes

# The root project's dependencies without the dev group: omni-algos, omni-rewards with its
# CPU-capable extras, omni-adapters, diffusion-rollout[server] and
# omni-train[tensorboard,ray,wandb,parquet]. Then a check that the install works.
RUN uv sync --locked --no-dev --no-editable \
    && omni-train --version \
    && omni-train recipes list > /dev/null

WORKDIR /workspace
CMD ["omni-train", "--help"]
