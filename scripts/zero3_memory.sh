#!/usr/bin/env bash
# ZeRO-3's memory, measured: a 525 M-parameter MoE LM (24 blocks of dim 1024, 8 experts of hidden
# 768, top-2, over bytes) trains 3 steps on one process (dist.zero = 0) and on 4 (dist.zero = 3);
# each run prints the largest rank's peak resident memory (VmHWM) and the estimate it started with.
# Fails unless each ZeRO-3 rank's peak is at most 0.35 × the one-process peak and every peak is
# within 10% of its estimate. About 9 GB for the one process, 2.5 GB per ZeRO-3 rank.
#   scripts/zero3_memory.sh [build/moetrain]
set -euo pipefail
bin=$(realpath "${1:-build/moetrain}")
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" prepare --input /usr/share/games/fortunes --out "$tmp/data" --no-progress >/dev/null
sets=(model.dim=1024 model.n_layers=24 model.n_heads=8 model.n_kv_heads=4 model.expert_hidden=768
      model.n_experts=8 model.top_k=2 model.max_seq_len=32 train.batch_size=1 train.seq_len=32
      train.steps=3 train.eval_every=0 train.eval_batches=1 train.checkpoint_every=0
      train.progress=off train.precision=f32 optim.warmup_steps=1 "data.dir=$tmp/data")
args=(train --config "$src/configs/tiny.toml")
for s in "${sets[@]}"; do args+=(--set "$s"); done
mpi=(mpiexec -n 4 --oversubscribe -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)

# "memory per rank: peak resident A MiB (the largest rank's VmHWM), estimated B MiB" → "A B"
peak_and_estimate() {
  sed -n 's/.*memory per rank: peak resident \([0-9.]*\) MiB.*estimated \([0-9.]*\) MiB.*/\1 \2/p' \
    "$1" | tail -1
}
"$bin" "${args[@]}" --set "train.run_dir=$tmp/one" >"$tmp/one.log" 2>&1 ||
  { cat "$tmp/one.log"; exit 1; }
"${mpi[@]}" "$bin" "${args[@]}" --set "train.run_dir=$tmp/z3" --set dist.zero=3 \
  >"$tmp/z3.log" 2>&1 || { cat "$tmp/z3.log"; exit 1; }
read -r one one_est < <(peak_and_estimate "$tmp/one.log")
read -r z3 z3_est < <(peak_and_estimate "$tmp/z3.log")
grep -m1 "parameters" "$tmp/one.log" || true
awk -v one="$one" -v one_est="$one_est" -v z3="$z3" -v z3_est="$z3_est" 'BEGIN {
  printf "%-28s %10s %10s %8s\n", "run", "peak MiB", "estimate", "peak/est"
  printf "%-28s %10.0f %10.0f %8.3f\n", "1 process, dist.zero = 0", one, one_est, one / one_est
  printf "%-28s %10.0f %10.0f %8.3f\n", "4 processes, dist.zero = 3", z3, z3_est, z3 / z3_est
  printf "ZeRO-3 rank / one process: %.3f (at most 0.35)\n", z3 / one
  ok = z3 / one <= 0.35 && (one / one_est - 1) ^ 2 <= 0.01 && (z3 / z3_est - 1) ^ 2 <= 0.01
  exit ok ? 0 : 1
}'
