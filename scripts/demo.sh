#!/usr/bin/env bash
# make demo: until the trainer lands, shows the GEMM engine every layer runs on.
set -euo pipefail
build=${1:-build}
"$build/moetrain" version
"$build/bench/bench_gemm" --benchmark_min_time=0.2
