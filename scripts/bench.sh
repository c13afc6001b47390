#!/usr/bin/env bash
# make bench: every benchmark, figures to stdout and JSON under out/bench/.
set -euo pipefail
build=${1:-build}
mkdir -p out/bench
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  echo "== $name"
  "$b" --benchmark_repetitions=${BENCH_REPS:-5} --benchmark_report_aggregates_only=true \
       --benchmark_out="out/bench/$name.json" --benchmark_out_format=json
done
