#!/usr/bin/env bash
# Long fuzz runs of the host parsers and the MSCCL differential test (CI runs the same targets with
# 10,000 executions each and 6,000 differential cases).
#
#   scripts/fuzz.sh                      # 1,000,000 executions per target, 200,000 differential cases
#   OXCCL_FUZZ_CASES=5000000 scripts/fuzz.sh
#   MSCCL_DIFF_CASES=1000000 scripts/fuzz.sh differential
#
# Arguments pick targets: msccl, text, layout, differential (default: all). Each case is
# deterministic in its seed; proptest saves a failing input under host/tests/*.proptest-regressions
# (turn each into a named regression test), the differential test prints the file and both
# verdicts. A hang exits with the input printed (tests/fuzz_common).
set -euo pipefail
cd "$(dirname "$0")/.."

export OXCCL_FUZZ_CASES="${OXCCL_FUZZ_CASES:-1000000}"
export MSCCL_DIFF_CASES="${MSCCL_DIFF_CASES:-200000}"
export MSCCL_DIFF_REAL="${MSCCL_DIFF_REAL:-200}"
# A different part of the input space each run unless a seed is given (PROPTEST_RNG_SEED).
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-$(date +%s)}"

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(msccl text layout differential)

for t in "${targets[@]}"; do
  case "$t" in
    msccl) test=fuzz_program_msccl ;;
    text) test=fuzz_program_text ;;
    layout) test=fuzz_reshard_layout ;;
    differential) test=msccl_differential ;;
    *) echo "unknown target $t (msccl, text, layout, differential)" >&2; exit 2 ;;
  esac
  echo "== $test: OXCCL_FUZZ_CASES=$OXCCL_FUZZ_CASES MSCCL_DIFF_CASES=$MSCCL_DIFF_CASES PROPTEST_RNG_SEED=$PROPTEST_RNG_SEED"
  cargo test -p oxccl-host --release --test "$test" -- --nocapture
done
