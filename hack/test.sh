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

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo build (binaries the integration tests run)"
cargo build --workspace --bins --locked
echo "== cargo test"
cargo test --workspace --locked
