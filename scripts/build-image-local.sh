#!/usr/bin/env bash
# Build the plimsoll image on a machine with no image registry and no Docker
# daemon, then serve one completion from the built image.
#
# What it is: the Dockerfile's own steps, run by `buildah bud --isolation chroot`
# on a base made from Debian packages by `mmdebstrap` (so no registry pull is
# needed), followed by a smoke run: `plimsoll serve` started from the image's
# filesystem (`buildah run`), one /v1/completions request over 127.0.0.1, then
# stop. What it is not: the release build — .github/workflows/release.yml builds
# and pushes the CPU and CUDA images on a tag with Docker Buildx.
#
# Needs root, mmdebstrap and buildah (`apt-get install mmdebstrap buildah`).
# The build machine's pip settings are passed into the build: its CA bundle
# (PIP_CERT) is mounted read-only, so pip behind a TLS-intercepting proxy works;
# TORCH_INDEX_URL defaults to PyPI where download.pytorch.org is unreachable
# (PyPI's Linux torch wheel is the CUDA build: a larger image, same code).
#
#   sudo scripts/build-image-local.sh            # build + smoke test
#   TAG=localhost/plimsoll:dev-cpu PORT=18080 scripts/build-image-local.sh
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${TAG:-localhost/plimsoll:dev-cpu}
BASE_TAG=${BASE_TAG:-localhost/plimsoll-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}
HOST_CA=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
PORT=${PORT:-18080}
WORK=${WORK:-$(mktemp -d)}
t0=$(date +%s)
stamp() { printf '[image %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }

for tool in mmdebstrap buildah curl; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found; install it (apt-get install mmdebstrap buildah curl)" >&2; exit 2; }
done

if ! buildah inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
  # No compiler in the base: the Dockerfile's build stage installs g++ (from the same mirror)
  # to compile the CPU kernels, and the image it ships fails to build if one came along.
  stamp "base: mmdebstrap bookworm with python3, venv (about 3 min) -> $BASE_TAG"
  mmdebstrap --mode=root --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$WORK/base.tar" "$MIRROR" >"$WORK/mmdebstrap.log" 2>&1 \
    || { tail -20 "$WORK/mmdebstrap.log" >&2; exit 1; }
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$WORK/base.tar" / >/dev/null
  buildah commit --quiet "$ctr" "$BASE_TAG" >/dev/null
  buildah rm "$ctr" >/dev/null
else
  stamp "base: $BASE_TAG already built"
fi

stamp "image: buildah bud the Dockerfile (pip installs torch and plimsoll; several minutes) -> $TAG"
buildah bud --isolation chroot --layers -t "$TAG" \
  --build-arg BASE_IMAGE="$BASE_TAG" \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
  --build-arg PIP_CERT=/etc/ssl/host-ca.crt \
  -v "$HOST_CA:/etc/ssl/host-ca.crt:ro" . >"$WORK/bud.log" 2>&1 \
  || { tail -30 "$WORK/bud.log" >&2; exit 1; }
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$TAG"

stamp "smoke: plimsoll serve from the image's filesystem on 127.0.0.1:$PORT"
ctr=$(buildah from "$TAG")
cleanup() { kill "${serve_pid:-0}" 2>/dev/null || true; wait "${serve_pid:-0}" 2>/dev/null || true; buildah rm "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT
buildah run --isolation chroot "$ctr" -- plimsoll serve --host 127.0.0.1 --port "$PORT" >"$WORK/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 300); do
  curl -fsS "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  kill -0 "$serve_pid" 2>/dev/null || { tail -30 "$WORK/serve.log" >&2; exit 1; }
  sleep 1
done
model=$(curl -fsS "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
stamp "model: $model"
curl -fsS "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\":\"$model\",\"prompt\":\"The capital of France is\",\"max_tokens\":8,\"temperature\":0}"
echo
stamp "done: $TAG serves completions (logs in $WORK)"
