# One image for every plimsoll part: runtime (`plimsoll serve`), bench, router and
# the operator. CPU by default; for NVIDIA GPUs build with a CUDA base and the
# matching PyTorch wheel index:
#
#   docker build -t plimsoll:cpu .
#   docker build -t plimsoll:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS=gpu .
#
# The embedded SmolLM2-135M model is converted at build time into
# /opt/plimsoll/models, so `embedded://smollm2-135m` needs no network at run time.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
# The build machine's pip settings, for builds behind a proxy or a private index
# (e.g. --build-arg PIP_INDEX_URL=... --build-arg PIP_CERT=/path/in/base/ca.crt).
# Unset ARGs stay out of the environment, so pip's defaults hold otherwise.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
ARG PIP_TRUSTED_HOST

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PLIMSOLL_CACHE_DIR=/opt/plimsoll/models \
    HOME=/home/plimsoll

# CUDA bases ship without Python; the python:* base already has it (with its headers).
# python3-dev: Triton compiles a C launcher against Python's headers at its first kernel
# launch, so the CUDA image needs them (checked below, after the install). g++ builds the
# CPU kernels (runtime/kernels/csrc) at first use for the node's own CPU; without it
# `plimsoll serve` on CPU falls back to slower torch paths.
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python3-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && if ! command -v c++ >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv "$VIRTUAL_ENV" \
 && groupadd --gid 1000 plimsoll \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/plimsoll --shell /usr/sbin/nologin plimsoll

WORKDIR /src
COPY pyproject.toml README.md ./
COPY common/ common/
COPY runtime/ runtime/
COPY bench/ bench/
COPY operator/ operator/
COPY router/ router/
COPY devcluster/ devcluster/

# Where Triton is installed (the CUDA build), compile a module the way Triton compiles its
# launcher: an image that could not would otherwise fail its first request on a GPU.
RUN pip install --upgrade pip \
 && pip install --extra-index-url "$TORCH_INDEX_URL" ".${EXTRAS:+[$EXTRAS]}" \
 && if python -c "import triton" 2>/dev/null; then \
      TRITON_CACHE_DIR="$(mktemp -d)" python -c "from plimsoll.runtime.serve_args import check_triton_toolchain; check_triton_toolchain(); print('triton launcher toolchain: ok')"; \
    fi \
 && python -c "from plimsoll.runtime.models.embedded import ensure_embedded_model; ensure_embedded_model('smollm2-135m')" \
 && chown -R 1000:1000 /opt/plimsoll \
 && rm -rf /src

WORKDIR /home/plimsoll
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["plimsoll"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
