#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) each, two at a time, from
# the committed seeds (fuzz/corpus/TARGET) plus what earlier runs found
# (target/fuzz-corpus/TARGET, not committed). Needs a nightly toolchain and
# cargo-fuzz; without them it says so and exits 0 (hack/test.sh calls it).
# A crash leaves its input in fuzz/artifacts/TARGET/ and fails the run.
# Prints, per target: executions, new corpus inputs, and the outcome.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}

if ! cargo +nightly --version >/dev/null 2>&1 || ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== fuzzing skipped: needs a nightly toolchain and cargo-fuzz (cargo install cargo-fuzz)"
  exit 0
fi

targets=(connect_head agent_identifiers capture cni_plugin server_stream agent_stream frontend_stream uds_authority)
echo "== building fuzz targets (nightly, libFuzzer)"
(cd fuzz && cargo +nightly fuzz build -O >/dev/null)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run() { # target
  local target=$1 found=target/fuzz-corpus/$1
  mkdir -p "$found"
  (cd fuzz && cargo +nightly fuzz run -O "$target" "../$found" "corpus/$target" -- \
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
    printf '%-18s %8s runs in %ss, corpus %s, %s\n' "$target" "${execs:-?}" "$seconds" "$corpus" "$outcome"
    if [[ $outcome != ok ]]; then
      grep -E "panicked|ERROR|SUMMARY|Test unit written" "$logs/$target.log" | head -20 >&2
    fi
  done
done
exit "$failed"
