#!/usr/bin/env bash
# Installs what the tests need (Debian packages) and runs every test:
# formatting, clippy, unit tests and the integration tests that drive the
# real binaries. Run as root on Debian: bash hack/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Programs the tests use, by the Debian package that ships them.
packages=(curl socat openssl iproute2 nftables nginx-light containernetworking-plugins)
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

# A second, independent gRPC implementation for the protocol tests.
if ! python3 -c 'import grpc, grpc_tools' 2>/dev/null; then
  echo "== installing grpcio and grpcio-tools (PyPI)"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-pip >/dev/null
  fi
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    'grpcio>=1.60,<2' 'grpcio-tools>=1.60,<2'
fi

# Offline schema validation of the rendered manifests (tests/tests/manifests.rs).
if ! python3 -c 'import kubernetes_validate' 2>/dev/null; then
  echo "== installing kubernetes-validate (PyPI)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    'kubernetes-validate>=1.31,<2'
fi
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
echo "== cargo test"
cargo test --workspace --locked --no-fail-fast

# Fuzzing, when a nightly toolchain and cargo-fuzz are installed (the corpora
# also run as ordinary tests above): FUZZ_SECONDS per target, 0 to skip.
if [[ ${FUZZ_SECONDS:-60} != 0 ]]; then
  echo "== fuzzing (hack/fuzz.sh ${FUZZ_SECONDS:-60})"
  bash hack/fuzz.sh "${FUZZ_SECONDS:-60}"
fi
