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
ARG TORCH_VERSION=2.15.0
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

# CUDA bases ship without Python; the python:* base already has it. g++ builds the
# CPU kernels (runtime/kernels/csrc) at first use for the node's own CPU; without it
# `plimsoll serve` on CPU falls back to slower torch paths.
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && if ! command -v c++ >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv "$VIRTUAL_ENV" \
 && groupadd --gid 1000 plimsoll \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/plimsoll --shell /usr/sbin/nologin plimsoll

WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
COPY common/ common/
COPY runtime/ runtime/
COPY bench/ bench/
COPY operator/ operator/
COPY router/ router/
COPY devcluster/ devcluster/

# Dependencies in three steps, one index each (never --extra-index-url, which lets the highest
# version on any index win): everything but torch exactly as requirements.lock pins it, hashes
# checked, from PyPI; then torch (with its CUDA libraries and triton on a CUDA base) from the one
# PyTorch index of this build, its other dependencies already satisfied by the locked ones; then
# plimsoll itself without resolving anything. Regenerate the lock with scripts/lock-requirements.sh.
# The weights stay root's: the serving user (1000) can read them, not change them.
RUN pip install --require-hashes --no-deps -r requirements.lock \
 && pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" \
 && case ",$EXTRAS," in *,gpu,*) pip install --index-url "$TORCH_INDEX_URL" triton ;; esac \
 && pip install --no-deps --no-build-isolation . \
 && python -c "from plimsoll.runtime.models.embedded import ensure_embedded_model; ensure_embedded_model('smollm2-135m')" \
 && chmod -R a+rX,go-w /opt/plimsoll \
 && rm -rf /src

WORKDIR /home/plimsoll
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["plimsoll"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
