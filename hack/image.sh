#!/usr/bin/env bash
# Builds the konnectivity-rs image from the Dockerfile, smoke-tests it, and
# exports its root filesystem to target/image/rootfs, where the tests that
# run the scenarios with the image's own binaries, nft and libc find it
# (tests/tests/image.rs and the *_from_the_image tests).
#
#   bash hack/image.sh [TAG]          (default konnectivity-rs:dev)
#
# Docker: the daemon that answers. When none does and this runs as root, it
# installs Debian's docker.io if needed and starts dockerd itself, changing
# nothing in the machine's network (no bridge, no iptables rules, no
# forwarding), and stops it again at the end.
# Base images: pulled when a registry answers; otherwise built here from
# Debian packages under the names the Dockerfile uses, so the Dockerfile
# builds unchanged either way (it says which path it took).
# CA_BUNDLE: a CA bundle for cargo inside the build, for machines behind a
# TLS-inspecting proxy (default: this machine's bundle; empty: none). It is
# a BuildKit secret: it never lands in a layer.
set -euo pipefail
cd "$(dirname "$0")/.."

image=${1:-konnectivity-rs:dev}
out=target/image
ca_bundle=${CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
mkdir -p "$out"
started=$SECONDS

say() { echo "== image: $*"; }
fail() {
  echo "hack/image.sh: $*" >&2
  exit 1
}
apt_install() {
  say "installing $* (Debian)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---- a Docker daemon ---------------------------------------------------------
dockerd_pid=
stop_dockerd() {
  if [[ -n $dockerd_pid ]]; then
    say "stopping the dockerd this script started"
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.2; done
  fi
}
trap stop_dockerd EXIT

if ! docker info >/dev/null 2>&1; then
  ((EUID == 0)) || fail "no Docker daemon answers, and starting one needs root"
  command -v dockerd >/dev/null && command -v docker >/dev/null || apt_install docker.io
  say "starting dockerd (--bridge=none, no iptables, no IP forwarding or masquerading)"
  dockerd --bridge=none --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false \
    >"$out/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || fail "dockerd did not start; its log: $out/dockerd.log"
fi

# ---- base images ---------------------------------------------------------------
channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
mirrors=(
  "deb http://deb.debian.org/debian bookworm main"
  "deb http://deb.debian.org/debian bookworm-updates main"
  "deb http://deb.debian.org/debian-security bookworm-security main"
)

# A bookworm root filesystem as a tar, from Debian's packages.
debian_rootfs() { # TAR [mmdebstrap options...]
  local tar=$1
  shift
  command -v mmdebstrap >/dev/null || apt_install mmdebstrap
  mmdebstrap --variant=minbase --quiet \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$@" bookworm "$tar" "${mirrors[@]}"
}

build_debian_slim() { # NAME
  debian_rootfs "$out/debian.tar"
  docker import --change 'CMD ["bash"]' "$out/debian.tar" "$1" >/dev/null
  rm -f "$out/debian.tar"
}

# The same, with gcc and libc6-dev for the crates that compile C (ring,
# mimalloc), and this machine's Rust toolchain, which must be the channel
# rust-toolchain.toml pins (no other can be downloaded here).
build_rust() { # NAME
  command -v rustc >/dev/null || fail "building $1 locally copies this machine's Rust toolchain, and rustc is not installed"
  local version sysroot
  version=$(rustc --version)
  [[ $version == "rustc $channel "* ]] || fail "building $1 locally needs Rust $channel here (rust-toolchain.toml), found: $version"
  sysroot=$(rustc --print sysroot)
  debian_rootfs "$out/rust.tar" --include=gcc,libc6-dev,ca-certificates \
    --customize-hook="tar -C '$sysroot' -c bin lib libexec | tar -C \"\$1/usr/local\" -x"
  docker import \
    --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV CARGO_HOME=/usr/local/cargo' \
    "$out/rust.tar" "$1" >/dev/null
  rm -f "$out/rust.tar"
}

for base in $(awk '/^FROM /{print $2}' Dockerfile); do
  case $base in
    docker.io/library/rust:*-bookworm)
      [[ $base == "docker.io/library/rust:$channel-bookworm" ]] ||
        fail "the Dockerfile builds with $base but rust-toolchain.toml pins $channel"
      recipe=build_rust
      ;;
    docker.io/library/debian:bookworm-slim) recipe=build_debian_slim ;;
    *) fail "the Dockerfile names $base, which this script cannot build without a registry" ;;
  esac
  if docker image inspect "$base" >/dev/null 2>&1; then
    say "$base: already present"
  elif timeout 300 docker pull -q "$base" >/dev/null 2>&1; then
    say "$base: pulled from the registry"
  else
    say "$base: no registry answers; building it from Debian packages (mmdebstrap)"
    base_started=$SECONDS
    "$recipe" "$base"
    say "$base: built locally in $((SECONDS - base_started)) s"
  fi
done

# ---- the image -------------------------------------------------------------------
# BuildKit (cache mounts, secrets): newer docker clients need the buildx
# plugin for it; Debian's docker.io client (20.10) has it built in.
builder=(docker)
if ! docker buildx version >/dev/null 2>&1; then
  if [[ -x /usr/bin/docker ]] && /usr/bin/docker version -f '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.'; then
    builder=(/usr/bin/docker)
  else
    fail "docker build needs BuildKit: install the buildx plugin, or Debian's docker.io for its client"
  fi
fi
secret=()
if [[ -n $ca_bundle ]]; then
  [[ -s $ca_bundle ]] || fail "CA_BUNDLE=$ca_bundle is not a file"
  secret=(--secret "id=ca-bundle,src=$ca_bundle")
fi
say "docker build $image (the whole log: $out/build.log)"
build_started=$SECONDS
# cargo compiles the dependencies for minutes without a line worth showing:
# say every minute that the build goes on, and where it is.
: >"$out/build.log"
(
  started=$(date +%s)
  while sleep 60; do
    say "docker build still running ($(($(date +%s) - started)) s): $(tail -n 1 "$out/build.log" | cut -c1-100)"
  done
) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true; stop_dockerd' EXIT
# Each step as it starts and ends, and cargo's progress, for a CI log.
if ! DOCKER_BUILDKIT=1 "${builder[@]}" build --network host --progress=plain "${secret[@]}" -t "$image" . 2>&1 |
  tee "$out/build.log" | grep --line-buffered -E '^#[0-9]+ (\[|DONE|ERROR|CACHED)|Compiling konnectivity|Finished'; then
  echo "---- the end of $out/build.log ----" >&2
  tail -n 40 "$out/build.log" >&2
  fail "docker build failed"
fi
# grep's status hides docker build's: check the image is the one just built.
grep -q '^#[0-9]* naming to .*'"$image"' done' "$out/build.log" || {
  tail -n 40 "$out/build.log" >&2
  fail "docker build failed"
}
kill "$ticker" 2>/dev/null || true
size=$(docker image inspect -f '{{.Size}}' "$image")
say "built $image in $((SECONDS - build_started)) s: $((size / 1024 / 1024)) MiB"

# ---- smoke test: every binary starts, every program they run is there --------
# Without a network there is nothing to forward: docker's warning that IPv4
# forwarding is off (we start dockerd so) says nothing here.
in_image() { docker run --rm --network none "$@" 2> >(grep -v "IPv4 forwarding is disabled" >&2); }
for binary in proxy-server proxy-agent proxy-test-client; do
  in_image "$image" "$binary" --help >/dev/null || fail "$binary --help fails in the image"
done
in_image -e CNI_COMMAND=VERSION "$image" konnectivity-cni </dev/null | grep -q supportedVersions ||
  fail "konnectivity-cni does not answer CNI VERSION in the image"
# node/src/programs.rs lists every program the binaries run.
while read -r program package; do
  in_image "$image" "$program" --version >/dev/null 2>&1 ||
    fail "the image lacks $program (Debian package $package), which proxy-agent runs (node/src/programs.rs)"
done < <(paste -d ' ' <(sed -n 's/^ *name: "\(.*\)",$/\1/p' node/src/programs.rs) \
  <(sed -n 's/^ *package: "\(.*\)",$/\1/p' node/src/programs.rs))
say "smoke test passed: the four binaries start, $(in_image "$image" nft --version)"

# ---- its files, for the scenarios run from the image -------------------------------
rm -rf "$out/rootfs"
mkdir -p "$out/rootfs"
# Created to be exported, never started: no network, so no forwarding warning.
container=$(docker create --network none "$image")
docker export "$container" | tar -C "$out/rootfs" -x
docker rm "$container" >/dev/null
docker image inspect -f '{{.Id}}' "$image" >"$out/rootfs.image-id"
say "root filesystem exported to $out/rootfs; image stage took $((SECONDS - started)) s"
