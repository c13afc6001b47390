#!/usr/bin/env bash
# Two moetrain binaries on the same ten kinds of 20-step runs (docs/measurements/step-engine.md):
# the LM on one process (f32; the MoE features; fp16) and on two (EP=2; ZeRO-1; local SGD; EP=2
# with placement), the classifier on one and two processes, and a parameter-server job. Prints,
# for each run, the SHA-256 of the final checkpoint's model files under both binaries and whether
# they agree; exits non-zero when any differs.
#   scripts/compare_bits.sh OLD_BINARY NEW_BINARY [WORK_DIR]
set -uo pipefail
old=$1; new=$2; work=${3:-$(mktemp -d)}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="$work/data"
[ -f "$data/train.bin" ] || "$new" prepare --input /usr/share/games/fortunes --out "$data" >/dev/null
lm="--config $root/configs/tiny.toml --set data.dir=$data --set train.steps=20
    --set train.eval_every=10 --set train.checkpoint_every=0 --set train.progress=off
    --set train.batch_size=8 --set train.seq_len=64 --set train.tensorboard=false"
cls="--config $root/configs/fashion_mnist.toml --set train.steps=20 --set train.progress=off
     --set train.tensorboard=false"
lm=$(echo $lm); cls=$(echo $cls)  # one line each: the commands are eval'ed
mpi="mpirun --allow-run-as-root --oversubscribe -n 2"
runs=(
  "lm|OMP_NUM_THREADS=2 BIN train $lm"
  "lm_features|OMP_NUM_THREADS=2 BIN train $lm --set model.capacity=dynamic --set model.capacity_factor=-1.25 --set model.router=sigmoid_bias --set grad.expert_reweight=utilisation --set grad.sparse_experts=true --set train.grad_accum=2"
  "lm_fp16|OMP_NUM_THREADS=2 BIN train $lm --set train.precision=fp16 --set model.router=sigmoid_bias"
  "lm_ep2|OMP_NUM_THREADS=1 $mpi BIN train $lm --set dist.ep=2"
  "lm_zero1|OMP_NUM_THREADS=1 $mpi BIN train $lm --set dist.zero=1"
  "lm_local_sgd|OMP_NUM_THREADS=1 $mpi BIN train $lm --set dist.sync=params --set dist.sync_every=4"
  "lm_placement|OMP_NUM_THREADS=1 $mpi BIN train $lm --set dist.ep=2 --set placement.spare_slots=1 --set placement.every=5"
  "classifier|OMP_NUM_THREADS=2 BIN classify $cls"
  "classifier_ep2|OMP_NUM_THREADS=1 $mpi BIN classify $cls --set dist.ep=2"
  "ps|OMP_NUM_THREADS=1 BIN ps launch --servers 1 --workers 2 -- train $lm --set optim.grad_clip=0"
)
digest() {  # the final checkpoint's model files, one digest
  local last; last=$(ls -d "$1"/checkpoints/*/ 2>/dev/null | sort | tail -1)
  [ -n "$last" ] || { echo "no-checkpoint"; return; }
  sha256sum "$last"/model*.safetensors | awk '{print $1}' | sha256sum | cut -c1-16
}
rc=0
for r in "${runs[@]}"; do
  name=${r%%|*}; cmd=${r#*|}
  for which in old new; do
    bin=$old; [ $which = new ] && bin=$new
    dir="$work/$which/$name"; rm -rf "$dir"
    eval "${cmd//BIN/$bin} --set train.run_dir=$dir" >"$work/$which-$name.log" 2>&1
  done
  a=$(digest "$work/old/$name"); b=$(digest "$work/new/$name")
  same=same; [ "$a" = "$b" ] && [ "$a" != no-checkpoint ] || { same=DIFFERENT; rc=1; }
  printf '%-16s %s %s %s\n' "$name" "$a" "$b" "$same"
done
exit $rc
