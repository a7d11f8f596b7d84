# syntax=docker/dockerfile:1
# omni-rl for Huawei Ascend NPUs (Atlas 800 A2 / 910B): torch + torch_npu on a CANN base image.
# Build from the repository root:
#
#   docker build -f docker/ascend.Dockerfile -t omni-rl:ascend .
#
# Versions follow Ascend's torch_npu compatibility table (TorchNPU 26.1.1): torch 2.12.0,
# torch_npu 2.12.0.post2, CANN 9.1.x. They move together; an A3 machine takes the a3 base image
# (--build-arg CANN_IMAGE=quay.io/ascend/cann:9.1.0-a3-ubuntu22.04-py3.12). uv.lock pins a newer
# torch than torch_npu supports, so this image installs the packages from the checkout with torch
# held at TORCH_VERSION instead of `uv sync --locked`. docs/install.md has the `docker run` line
# (the NPU devices and the driver come from the host) and what is and is not tested on NPUs.

ARG UV_VERSION=0.13.9
ARG CANN_IMAGE=quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM ${CANN_IMAGE}

ARG TORCH_VERSION=2.12.0
ARG TORCH_NPU_VERSION=2.12.0.post2

COPY --from=uv /uv /uvx /usr/local/bin/

ENV UV_SYSTEM_PYTHON=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    UV_BREAK_SYSTEM_PACKAGES=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# torch from PyTorch's CPU index (torch_npu's install instructions, x86_64 and aarch64 alike),
# then torch_npu and the two packages its install guide asks for.
RUN uv pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && uv pip install "torch-npu==${TORCH_NPU_VERSION}" pyyaml setuptools

WORKDIR /src/omni-rl
COPY packages ./packages
COPY recipes ./recipes
COPY docker/ascend-entrypoint.sh /usr/local/bin/omni-rl-entrypoint

# omni-rl's packages from this checkout, with torch held at the version torch_npu was built for.
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt \
    && uv pip install --constraint /tmp/torch-constraint.txt \
        ./packages/omni-algos \
        "./packages/omni-rewards[ocr,clip,clap,latent,math,server]" \
        ./packages/omni-adapters \
        "./packages/diffusion-rollout[server]" \
        "./packages/omni-train[tensorboard,parquet]" \
    && rm /tmp/torch-constraint.txt \
    && omni-train --version \
    && omni-train recipes list > /dev/null

WORKDIR /workspace
# Loads CANN's environment (set_env.sh) before every command.
ENTRYPOINT ["/usr/local/bin/omni-rl-entrypoint"]
CMD ["omni-train", "--help"]
