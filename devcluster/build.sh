#!/usr/bin/env bash
# Builds the local Kubernetes control plane from Go modules into a cache outside
# the repository: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
# (k8s.io/kubernetes, staging modules replaced by their published v0.x versions,
# version-stamped), etcd, kwok and helm. Each product is built once per pinned
# version and Go version; a present binary is never rebuilt.
#
# Usage: devcluster/build.sh [k8s|etcd|kwok|helm ...]   (default: all)
# Env:   PLIMSOLL_CACHE (default ~/.cache/plimsoll), KVER, EVER, KWOKVER, HELMVER,
#        PLIMSOLL_TESTPLANE_DIR (the whole cache dir). `plimsoll dev up` passes all of
#        them from devcluster/paths.py, the single source of truth for versions.
set -euo pipefail

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
KVER=${KVER:-1.37.2}
EVER=${EVER:-3.6.14}
KWOKVER=${KWOKVER:-0.8.0}
HELMVER=${HELMVER:-4.3.1}
GOVER=$(go env GOVERSION)
ARCH=$(uname -m)
CACHE=${PLIMSOLL_TESTPLANE_DIR:-${PLIMSOLL_CACHE:-$HOME/.cache/plimsoll}/testplane/$GOVER-$ARCH}
SVER=0.${KVER#1.}
MINOR=$(cut -d. -f2 <<<"$KVER")
mkdir -p "$CACHE"
# One build at a time per cache: each product's module dir is wiped before it is
# built, so a second build beside the first (a test fixture, `plimsoll dev up` in
# another shell) would delete the first one's working directory under it.
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then
  printf '[build %s] another build holds %s; waiting for it\n' "$(date +%H:%M:%S)" "$CACHE/.build.lock"
  flock 9
fi

step() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { printf '[build] FAILED: %s (log: %s)\n' "$1" "$2" >&2; tail -n 30 "$2" >&2; exit 1; }

build_k8s() {
  local out=$CACHE/k8s-v$KVER/bin log=$CACHE/k8s-v$KVER/build.log
  if [[ -x $out/kube-apiserver && -x $out/kube-controller-manager && -x $out/kube-scheduler && -x $out/kubectl ]]; then
    step "k8s v$KVER cached in $out"; return; fi
  mkdir -p "$out"; : >"$log"
  local w=$CACHE/k8s-v$KVER/mod; rm -rf "$w"; mkdir -p "$w"; cd "$w"
  step "k8s v$KVER: resolving modules (log: $log)"
  {
    go mod init example.invalid/plimsoll-testplane-k8s
    go mod edit -go=1.26.0 -godebug=default=go1.26
    local gomod
    gomod=$(go mod download -json "k8s.io/kubernetes@v$KVER" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
    for m in $(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/src/.*#\1#p' "$gomod"); do
      go mod edit -replace="$m=$m@v$SVER"
    done
    go mod edit -require="k8s.io/kubernetes@v$KVER"
    go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v$KVER" "k8s.io/kubernetes/cmd/kube-controller-manager@v$KVER" \
      "k8s.io/kubernetes/cmd/kube-scheduler@v$KVER" "k8s.io/kubernetes/cmd/kubectl@v$KVER"
  } >>"$log" 2>&1 || fail "k8s module resolution" "$log"
  local ldv="-X k8s.io/component-base/version.gitVersion=v$KVER -X k8s.io/component-base/version.gitMajor=1"
  ldv+=" -X k8s.io/component-base/version.gitMinor=$MINOR -X k8s.io/component-base/version.gitTreeState=clean"
  ldv+=" -X k8s.io/component-base/version.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  ldv+=" -X k8s.io/client-go/pkg/version.gitVersion=v$KVER -X k8s.io/client-go/pkg/version.gitMajor=1"
  ldv+=" -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
  local cmd
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    step "k8s v$KVER: compiling $cmd"
    go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "-s -w $ldv" -o "$out/$cmd.tmp" \
      "k8s.io/kubernetes/cmd/$cmd" >>"$log" 2>&1 || fail "k8s $cmd" "$log"
    mv "$out/$cmd.tmp" "$out/$cmd"
  done
  "$out/kube-apiserver" --version
}

build_etcd() {
  local out=$CACHE/etcd-v$EVER/bin log=$CACHE/etcd-v$EVER/build.log
  if [[ -x $out/etcd ]]; then step "etcd v$EVER cached in $out"; return; fi
  mkdir -p "$out"; : >"$log"
  local w=$CACHE/etcd-v$EVER/mod; rm -rf "$w"; mkdir -p "$w"; cd "$w"
  step "etcd v$EVER: building (log: $log)"
  {
    go mod init example.invalid/plimsoll-testplane-etcd
    go get -tool "go.etcd.io/etcd/server/v3@v$EVER"
    go build -trimpath -ldflags "-s -w" -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3
  } >>"$log" 2>&1 || fail "etcd" "$log"
  mv "$out/etcd.tmp" "$out/etcd"
}

build_kwok() {
  local dir=$CACHE/kwok-v$KWOKVER log=$CACHE/kwok-v$KWOKVER/build.log
  if [[ -x $dir/bin/kwok && -f $dir/stages.yaml ]]; then step "kwok v$KWOKVER cached in $dir"; return; fi
  mkdir -p "$dir/bin"; : >"$log"
  step "kwok v$KWOKVER: building (log: $log)"
  GOBIN=$dir/bin go install "sigs.k8s.io/kwok/cmd/kwok@v$KWOKVER" >>"$log" 2>&1 || fail "kwok" "$log"
  local s
  s=$(go env GOMODCACHE)/sigs.k8s.io/kwok@v$KWOKVER/kustomize/stage
  local f
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo '---'; cat "$s/$f"
  done >"$dir/stages.yaml"
}

build_helm() {
  local out=$CACHE/helm-v$HELMVER/bin log=$CACHE/helm-v$HELMVER/build.log
  if [[ -x $out/helm ]]; then step "helm v$HELMVER cached in $out"; return; fi
  mkdir -p "$out"; : >"$log"
  step "helm v$HELMVER: building (log: $log)"
  GOBIN=$out go install -trimpath -ldflags "-s -w" "helm.sh/helm/v4/cmd/helm@v$HELMVER" >>"$log" 2>&1 || fail "helm" "$log"
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(etcd kwok helm k8s)
start=$(date +%s)
for t in "${targets[@]}"; do "build_$t"; done
step "done in $(( $(date +%s) - start ))s; binaries under $CACHE"
