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
#
# The CPU kernels (runtime/kernels/csrc) are compiled by `pip install` in the build stage, once
# for AVX-512, AVX2 and plain x86-64 (setup.py); the server loads the one its node's CPU runs.
# The image itself has no compiler: the build stage's g++ stays behind.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# What both stages share: Python, the virtual environment's place, the plimsoll user.
FROM ${BASE_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PLIMSOLL_CACHE_DIR=/opt/plimsoll/models \
    HOME=/home/plimsoll

# CUDA bases ship without Python; the python:* base already has it.
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 1000 plimsoll \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/plimsoll --shell /usr/sbin/nologin plimsoll

# Build stage: g++ compiles the CPU kernels while plimsoll is installed into the venv.
FROM base AS build

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

RUN if ! command -v c++ >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
COPY requirements.lock pyproject.toml setup.py README.md ./
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
 && python -c "import pathlib, plimsoll.runtime.kernels as k; \
built = sorted(p.name for p in pathlib.Path(k.__file__).parent.glob('libplimsoll_*.so')); \
print('CPU kernels built:', built); assert len(built) >= 2, built"

# The image: the venv and the converted model (root's: the serving user reads them), without the compiler.
FROM base

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/plimsoll /opt/plimsoll
# Fails the build if a compiler came along, or if the kernels do not load without one.
RUN ! command -v c++ && ! command -v g++ && ! command -v cc \
 && python -c "from plimsoll.runtime.kernels import cpu_kernels; s = cpu_kernels.select(); \
assert s.library is not None, s.reason; print('CPU kernels:', s.library.variant, 'build loads')"

WORKDIR /home/plimsoll
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["plimsoll"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
