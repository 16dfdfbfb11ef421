#!/usr/bin/env bash
# The kernels' fuzzing and sanitizer runs (make fuzz, make sanitize; .ci/run runs both, bounded).
#   tests/fuzz/run.sh sanitize        kernel_cases.cpp's tables, then every fuzz target over its seed corpus, built
#                                     by g++ (or $CXX) with AddressSanitizer and UndefinedBehaviorSanitizer
#   tests/fuzz/run.sh fuzz [SECONDS]  each libFuzzer target for SECONDS (default 600), one after another, in one
#                                     process each; new inputs go to build/fuzz/corpus/<target>, crashes to
#                                     build/fuzz/crashes/. Needs clang++ with libFuzzer: without it, a one-line skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/fuzz
read -r -a TARGETS <<< "${FUZZ_TARGETS:-attention commit q4 q8}"  # a subset: FUZZ_TARGETS="q4 q8"
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -Wall -Wno-psabi -pthread
       -fno-sanitize-recover=all)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# compile OUTPUT SOURCE... with the sanitizers in $SANITIZE, quietly unless it fails.
compile() {
  local output=$1
  shift
  if ! log=$("$COMPILER" "${FLAGS[@]}" "-fsanitize=$SANITIZE" "$@" -o "$output" 2>&1); then
    echo "$log" >&2
    return 1
  fi
}

sanitize() {
  COMPILER=${CXX:-g++} SANITIZE=address,undefined
  FLAGS+=(-Wno-maybe-uninitialized)  # GCC's AVX-512 intrinsics at -O1
  mkdir -p "$OUT"
  compile "$OUT/kernel_cases" tests/fuzz/kernel_cases.cpp &
  for target in "${TARGETS[@]}"; do
    [[ $(jobs -r | wc -l) -lt 2 ]] || wait -n
    compile "$OUT/corpus_$target" "tests/fuzz/fuzz_$target.cpp" tests/fuzz/corpus_main.cpp &
  done
  while [[ $(jobs -r | wc -l) -gt 0 ]]; do wait -n; done
  wait
  "$OUT/kernel_cases"
  for target in "${TARGETS[@]}"; do "$OUT/corpus_$target" "tests/fuzz/corpus/$target"; done
}

fuzz() {
  local seconds=${1:-600}
  COMPILER=${CXX_FUZZ:-clang++} SANITIZE=fuzzer,address,undefined
  if ! command -v "$COMPILER" >/dev/null; then
    echo "fuzz: skipped: $COMPILER is not installed (Debian: apt-get install clang)"
    return 0
  fi
  mkdir -p "$OUT/crashes"
  for target in "${TARGETS[@]}"; do
    if ! compile "$OUT/fuzz_$target" "tests/fuzz/fuzz_$target.cpp" 2>/dev/null; then
      echo "fuzz: skipped: $COMPILER cannot link libFuzzer (-fsanitize=fuzzer; Debian: apt-get install clang)"
      return 0
    fi
  done
  for target in "${TARGETS[@]}"; do
    local corpus="$OUT/corpus/$target" log="$OUT/fuzz_$target.log" start=$SECONDS
    mkdir -p "$corpus"
    if ! "$OUT/fuzz_$target" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$OUT/crashes/$target-" "$corpus" "tests/fuzz/corpus/$target" >"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "fuzz: $target FAILED after $((SECONDS - start)) s (input in $OUT/crashes/, log $log)" >&2
      return 1
    fi
    local runs
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    echo "fuzz: $target ran $((SECONDS - start)) s, $runs inputs, corpus $(find "$corpus" -type f | wc -l) files" \
         "(+ $(find "tests/fuzz/corpus/$target" -type f | wc -l) seeds): no crash"
  done
}

case "${1:-}" in
  sanitize) sanitize ;;
  fuzz) fuzz "${2:-600}" ;;
  *) echo "usage: tests/fuzz/run.sh sanitize | fuzz [SECONDS]" >&2; exit 2 ;;
esac
