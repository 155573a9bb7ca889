# Sourced by hack/test.sh and hack/demo.sh: stop at once, in one line, when
# what the build needs is missing, rather than minutes later inside cargo.
#   require_build_tools SCRIPT
require_build_tools() {
  local script=$1 channel
  channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
  if ! command -v cargo >/dev/null 2>&1; then
    echo "$script: cargo not found: install Rust $channel (https://rustup.rs; rust-toolchain.toml pins it)" >&2
    exit 1
  fi
  if ! command -v cc >/dev/null 2>&1; then
    echo "$script: no C compiler (cc), which ring and mimalloc need: apt-get install gcc libc6-dev" >&2
    exit 1
  fi
}
