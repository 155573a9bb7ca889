#!/usr/bin/env bash
# Installs what the tests need (Debian packages) and runs every test:
# formatting, clippy, unit tests and the integration tests that drive the
# real binaries. Run as root on Debian: bash hack/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/lib/build-tools.sh
require_build_tools hack/test.sh

# Programs the tests use, by the Debian package that ships them (the Go
# libraries build tests/go/*.go: a grpc-go client and Go's metrics parser).
packages=(curl socat openssl iproute2 nftables nginx-light containernetworking-plugins
  golang-go golang-google-grpc-dev golang-google-protobuf-dev golang-github-prometheus-common-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Clients that are not ours: Python grpcio (gRPC core) and grpc-go, which
# kube-apiserver's egress is built on. PyPI packages go into a virtual
# environment the project owns (hack/.venv), never into the system Python.
source hack/lib/python.sh
python_venv 'grpc:grpcio>=1.60,<2' 'grpc_tools:grpcio-tools>=1.60,<2' \
  'kubernetes_validate:kubernetes-validate>=1.31,<2'

# kubectl renders the kustomizations (its built-in kustomize). Debian does not
# package it; the manifest tests fail under CI without it.
if ! command -v kubectl >/dev/null 2>&1; then
  echo "hack/test.sh: kubectl not found; install it (https://kubernetes.io/docs/tasks/tools/) to run the manifest tests" >&2
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo build (binaries the integration tests run)"
cargo build --workspace --bins --locked
# The image, built from the Dockerfile as users build it; the tests run the
# capture and egress scenarios once more with its files (tests/tests/image.rs).
if ((EUID == 0)) || docker info >/dev/null 2>&1; then
  echo "== image (hack/image.sh)"
  image_started=$SECONDS
  bash hack/image.sh
  echo "== image stage: $((SECONDS - image_started)) s"
elif [[ -n ${CI:-} ]]; then
  echo "hack/test.sh: the image stage needs root or a Docker daemon, and CI is set" >&2
  exit 1
else
  echo "== image: skipped (needs root or a Docker daemon); the image tests will skip too"
fi

echo "== cargo test"
cargo test --workspace --locked --no-fail-fast

# Fuzzing, when a nightly toolchain and cargo-fuzz are installed (the corpora
# also run as ordinary tests above): FUZZ_SECONDS per target, 0 to skip.
if [[ ${FUZZ_SECONDS:-60} != 0 ]]; then
  echo "== fuzzing (hack/fuzz.sh ${FUZZ_SECONDS:-60})"
  bash hack/fuzz.sh "${FUZZ_SECONDS:-60}"
fi
