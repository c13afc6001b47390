#!/usr/bin/env bash
# make bench: every benchmark; Google Benchmark ones also write JSON under out/bench/.
# The MPI benchmarks (their own main) run under mpiexec with 2 processes. Last, the peer
# benchmarks against PyTorch 2.x (bench/peers/) with the Python of MOETRAIN_PEERS_PYTHON, by default
# .venv-bench/bin/python (scripts/setup.sh --peers); skipped, saying so, where it has no torch.
set -euo pipefail
build=${1:-build}
mkdir -p out/bench
mpi_run=(mpiexec -n 2 --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi_run+=(--allow-run-as-root)
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  echo "== $name"
  case "$name" in
    bench_alltoall)
      OMP_NUM_THREADS=1 "${mpi_run[@]}" "$b" ;;
    bench_dist_train_step)
      OMP_NUM_THREADS=1 "${mpi_run[@]}" "$b"
      # ZeRO-2 and ZeRO-3 step time against ZeRO-1's on the larger config (docs/sharding.md).
      OMP_NUM_THREADS=1 "${mpi_run[@]}" "$b" --stages 1 --dim 256 --layers 4 --bucket-mb 4 ;;
    bench_balance)
      # Step time on 2 ranks with a core each; the 4-rank run is for its load counters.
      OMP_NUM_THREADS=1 "${mpi_run[@]}" --bind-to core "$b" \
        --benchmark_out="out/bench/$name.json" --benchmark_out_format=json
      OMP_NUM_THREADS=1 mpiexec -n 4 --oversubscribe "${mpi_run[@]:4}" "$b" \
        --benchmark_out="out/bench/${name}_4ranks.json" --benchmark_out_format=json ;;
    bench_train_step)
      "$b" --benchmark_repetitions="${BENCH_REPS:-5}" --benchmark_report_aggregates_only=true \
           --benchmark_out="out/bench/$name.json" --benchmark_out_format=json
      # The bf16/f32 ratio step against step (docs/PERF.md, "Step against step").
      "$b" --paired --preset tiny --steps 31
      "$b" --paired --preset large --steps 11 ;;
    bench_cuda_step)
      # Its own main: the CUDA train step where a GPU is usable (else it says so and exits 0).
      "$b" ;;
    *)
      "$b" --benchmark_repetitions="${BENCH_REPS:-5}" --benchmark_report_aggregates_only=true \
           --benchmark_out="out/bench/$name.json" --benchmark_out_format=json ;;
  esac
done
# ZeRO-3's peak memory per rank against one process's, 525 M parameters (docs/sharding.md).
echo "== zero3_memory"
bash "$(dirname "$0")/zero3_memory.sh" "$build/moetrain"
# The planner's predicted step times against measured ones on this machine (docs/plan.md).
if [ -x "$build/tests/plan_validation_test" ]; then
  echo "== plan_validation_test"
  "$build/tests/plan_validation_test"
fi
# The MoE layer and the demo's LM against PyTorch 2.x in the same run (docs/PERF.md, "Against
# PyTorch").
echo "== peers (PyTorch)"
root="$(cd "$(dirname "$0")/.." && pwd)"
peers_py=${MOETRAIN_PEERS_PYTHON:-$root/.venv-bench/bin/python}
# torch 2.x: Debian's python3-torch (1.13, the tests' reference) has neither torch.compile nor
# scaled_dot_product_attention.
if [ -x "$peers_py" ] && "$peers_py" -s -c 'import sys, torch
sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; then
  "$peers_py" -s "$root/bench/peers/moe_layer.py" --bench "$build/bench/bench_moe_layer" \
    --rounds "${PEERS_ROUNDS:-3}"
  data=data/fortunes
  if [ ! -f "$data/train.bin" ] || [ ! -f "$data/val.bin" ]; then
    "$build/moetrain" prepare --input /usr/share/games/fortunes --out "$data"
  fi
  "$peers_py" -s "$root/bench/peers/lm.py" --moetrain "$build/moetrain" --data "$data" \
    --rounds "${PEERS_ROUNDS:-3}" --seconds "${PEERS_SECONDS:-60}"
else
  echo "peers: skipped: no PyTorch 2.x at $peers_py (scripts/setup.sh --peers installs it there," \
       "or set MOETRAIN_PEERS_PYTHON to a Python that has torch 2.x)"
fi
