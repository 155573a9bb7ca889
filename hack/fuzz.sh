#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) each, two at a time, with
# AddressSanitizer, from the committed seeds (fuzz/corpus/TARGET) plus what
# earlier runs found (target/fuzz-corpus/TARGET, not committed), and prints
# per target: executions, corpus size and the outcome. hack/test.sh calls
# it in every CI run.
#
#   bash hack/fuzz.sh [SECONDS]          fuzz
#   bash hack/fuzz.sh --minimise         merge what runs found into the committed
#                                        corpora, minimised (cargo fuzz cmin)
#
# cargo-fuzz is installed from crates.io when missing (into ~/.cargo/bin).
# A nightly toolchain is used when there is one; otherwise the pinned stable
# one builds the targets with RUSTC_BOOTSTRAP=1 (sanitizer flags are
# unstable options; checked on 1.95.0). A crash fails the run: its input is
# kept in fuzz/artifacts/TARGET/ and printed (base64) in the log, so a CI
# log alone reproduces it: `base64 -d > crash; cargo fuzz run TARGET crash`.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(connect_head agent_identifiers capture cni_plugin server_stream agent_stream frontend_stream resume_handshake)

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz (crates.io)"
  cargo install cargo-fuzz --locked --quiet
fi
# FUZZ_TOOLCHAIN=stable uses the pinned stable one even where a nightly is
# installed (as on a machine without one, such as CI's).
if [[ ${FUZZ_TOOLCHAIN:-} != stable ]] && cargo +nightly --version >/dev/null 2>&1; then
  fuzz() { cargo +nightly fuzz "$@"; }
  toolchain="nightly $(cargo +nightly --version | cut -d' ' -f2): this machine has one, cargo-fuzz's own;
    FUZZ_TOOLCHAIN=stable builds with the pinned stable one instead, as on a machine without nightly"
else
  fuzz() { RUSTC_BOOTSTRAP=1 cargo fuzz "$@"; }
  toolchain="stable $(rustc --version | cut -d' ' -f2) with RUSTC_BOOTSTRAP=1: $(
    [[ ${FUZZ_TOOLCHAIN:-} == stable ]] && echo "FUZZ_TOOLCHAIN=stable" || echo "no nightly on this machine")"
fi

if [[ ${1:-} == --minimise ]]; then
  # The committed seeds (seed-*, named for what they are) stay as they are;
  # of what runs found, the inputs a minimised corpus keeps beside them are
  # added, up to 1 KiB each (large inputs cost every `cargo test` that
  # replays the corpora, and add little coverage a small one would not).
  for target in "${targets[@]}"; do
    found=target/fuzz-corpus/$target merged=$(mktemp -d)
    mkdir -p "$found"
    cp "fuzz/corpus/$target"/* "$found"/* "$merged"/ 2>/dev/null || true
    (cd fuzz && fuzz cmin -O "$target" "$merged" >/dev/null 2>&1)
    added=0
    for input in "$merged"/*; do
      name=$(basename "$input")
      if [[ ! -e fuzz/corpus/$target/$name && $(stat -c %s "$input") -le 1024 ]]; then
        cp "$input" "fuzz/corpus/$target/$name"
        added=$((added + 1))
      fi
    done
    rm -rf "$merged"
    printf '%-18s %s inputs added, %s in the corpus\n' "$target" "$added" "$(find "fuzz/corpus/$target" -type f | wc -l)"
  done
  exit 0
fi

seconds=${1:-60}
echo "== building fuzz targets (libFuzzer, AddressSanitizer; $toolchain)"
(cd fuzz && fuzz build -O >/dev/null)
# cargo-fuzz has no --locked: a lockfile the build had to change is an error
# here, so the checkout stays as it was and every run builds the same.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && ! git diff --quiet -- fuzz/Cargo.lock; then
  echo "hack/fuzz.sh: fuzz/Cargo.lock was out of date (the build changed it): commit the updated file" >&2
  git diff --stat -- fuzz/Cargo.lock >&2
  exit 1
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run() { # target
  local target=$1 found=target/fuzz-corpus/$1
  mkdir -p "$found"
  (cd fuzz && fuzz run -O "$target" "../$found" "corpus/$target" -- \
    -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1) >"$logs/$target.log" 2>&1
}

failed=0
for ((i = 0; i < ${#targets[@]}; i += 2)); do
  pids=()
  for target in "${targets[@]:i:2}"; do
    run "$target" &
    pids+=($!)
  done
  for ((j = 0; j < ${#pids[@]}; j++)); do
    target=${targets[i + j]}
    if wait "${pids[j]}"; then outcome=ok; else outcome=CRASH; failed=1; fi
    execs=$(awk '/stat::number_of_executed_units/ { print $2 }' "$logs/$target.log")
    corpus=$(find "target/fuzz-corpus/$target" -type f | wc -l)
    printf '%-18s %10s runs in %ss, corpus %s, %s\n' "$target" "${execs:-?}" "$seconds" "$corpus" "$outcome"
    if [[ $outcome != ok ]]; then
      grep -E "panicked|ERROR|SUMMARY|Test unit written" "$logs/$target.log" | head -20 >&2
      for input in fuzz/artifacts/"$target"/*; do
        [[ -f $input ]] || continue
        echo "-- $input (base64):" >&2
        base64 -w 0 "$input" >&2
        echo >&2
      done
    fi
  done
done
exit "$failed"
