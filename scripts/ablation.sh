#!/usr/bin/env bash
# The optimisation ablation table (docs/ablation.md): every row of configs/ablation/rows.conf
# trained RUNS times on configs/ablation/model.toml by 4 MPI processes as 2 "nodes" of 2, then
# `moetrain report --ablation` writes OUT/table.md, OUT/table.json and OUT/ablation.svg.
#
#   scripts/ablation.sh [BUILD_DIR]        after `make build`; installs nothing
#
# The nodes are two network namespaces (mt-node0, mt-node1) joined by a veth pair whose both ends
# are rate-limited with tc (tbf at RATE, plus netem DELAY where the kernel has netem). Within a
# node the ranks talk over Open MPI's shared memory (vader), between nodes over TCP on the veth.
# mpirun runs inside mt-node0 and starts node 1's daemon through an rsh agent that does
# `ip netns exec mt-node1` instead of ssh. Each node also gets a host name of its own (a UTS
# namespace): Open MPI names its shared-memory segments after the host, and two nodes called
# alike would open each other's. Without root or without `ip netns` (or NETNS=off) the
# script says so and runs all 4 ranks on one host over loopback; setup.txt (quoted in the table)
# records which mode ran.
#
# Environment:
#   RATE=1gbit DELAY=     the inter-node link (DELAY e.g. 1ms; empty = none)
#   RUNS=3 STEPS=40 WARMUP=5   runs per row (medians), optimizer steps per run, untimed steps
#   QUICK=1               1 run per row, 8 steps, 2 warm-up: checks the machinery, not a figure
#   OUT=out/ablation      output folder (its runs/ are replaced)
#   ROWS=configs/ablation/rows.conf  the rows (a row the build refuses stops the script)
#   NETNS=auto|off        off: loopback even where namespaces work
#   UPDATE_DOCS=1         also copy the chart to docs/ablation.svg
# Whole run (RUNS=3, STEPS=40): meant to stay within about 15 minutes on 2 quiet cores.
set -euo pipefail
build=${1:-build}
bin="$build/moetrain"
config=configs/ablation/model.toml
rows_file=${ROWS:-configs/ablation/rows.conf}
out=${OUT:-out/ablation}
rate=${RATE:-1gbit}
delay=${DELAY:-}
if [ "${QUICK:-0}" = 1 ]; then
  runs=${RUNS:-1} steps=${STEPS:-8} warmup=${WARMUP:-2}
else
  runs=${RUNS:-3} steps=${STEPS:-40} warmup=${WARMUP:-5}
fi

die() { echo "ablation.sh: $*" >&2; exit 1; }
[ -x "$bin" ] || die "$bin not found: run \`make build\` first (or pass the build folder)"
[ -f "$rows_file" ] && [ -f "$config" ] || die "run from the repository root ($rows_file)"
command -v mpirun > /dev/null || die "mpirun not found (Open MPI)"
[ "$steps" -gt "$warmup" ] || die "STEPS=$steps must exceed WARMUP=$warmup"
if [ ! -f data/fortunes/train.bin ] || [ ! -f data/fortunes/val.bin ]; then
  "$bin" prepare --input /usr/share/games/fortunes --out data/fortunes
fi

# --- the two nodes ------------------------------------------------------------------------------
# shellcheck source=scripts/two_nodes.sh
. "$(dirname "$0")/two_nodes.sh"

# --- the rows -----------------------------------------------------------------------------------
names=()
declare -A sets=()
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%%#*}
  line=$(echo "$line" | xargs)
  [ -z "$line" ] && continue
  if [[ $line == row\ * ]]; then
    names+=("${line#row }")
    sets[${line#row }]=""
  elif [[ $line == include\ * ]]; then
    [ ${#names[@]} -gt 0 ] || die "$rows_file: '$line' comes before the first \`row NAME\`"
    from=${line#include }
    [ -n "${sets[$from]+set}" ] && [ "$from" != "${names[-1]}" ] ||
      die "$rows_file: '$line': no earlier row is called $from"
    sets[${names[-1]}]+="${sets[$from]}"
  else
    [ ${#names[@]} -gt 0 ] || die "$rows_file: '$line' comes before the first \`row NAME\`"
    [[ $line == *=* ]] || die "$rows_file: '$line' is not key=value"
    sets[${names[-1]}]+="$line"$'\n'
  fi
done < "$rows_file"
[ ${#names[@]} -gt 0 ] || die "$rows_file defines no row"

rm -rf "$out/runs"
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)  # the runs' directories are given to processes in other namespaces
# Each row's settings, checked together by the binary itself (a dry run validates and trains
# nothing): a row this build refuses stops the script before anything runs.
declare -A args=()
for row in "${names[@]}"; do
  a=()
  while IFS= read -r kv; do [ -n "$kv" ] && a+=(--set "$kv"); done <<< "${sets[$row]}"
  if ! err=$("$bin" train --dry-run --config "$config" "${a[@]}" 2>&1 > /dev/null); then
    err=${err##*error: }
    die "row $row is refused: ${err:0:300}"
  fi
  args[$row]="${a[*]}"
done

{
  echo "Setup: mode **$mode**$([ "$mode" = loopback ] && echo " ($why)") — 4 MPI ranks as 2 nodes of 2" \
    "(link: $link), EP = 4, OMP_NUM_THREADS=1, $(nproc --all) cores, $steps steps per" \
    "run$([ "${QUICK:-0}" = 1 ] && echo " — **QUICK run: checks the machinery, the figures mean nothing**")."
} > "$out/setup.txt"
cat "$out/setup.txt"

start=$SECONDS
for row in "${names[@]}"; do
  for k in $(seq 1 "$runs"); do
    dir="$out/runs/$row/$k"
    mkdir -p "$dir"
    echo "== $row run $k/$runs ($((SECONDS - start)) s)"
    # shellcheck disable=SC2086
    "${launch[@]}" "$bin" train --config "$config" ${args[$row]} --set train.steps="$steps" \
      --set train.seed=$((1233 + k)) --set train.run_dir="$dir" > "$dir/log.txt" 2>&1 &
    child=$!
    if ! wait "$child"; then
      child=0
      tail -20 "$dir/log.txt" >&2
      die "row $row run $k failed (log: $dir/log.txt)"
    fi
    child=0
    rm -rf "$dir"/checkpoints "$dir"/step_*  # only the metrics are read
  done
done
echo "== all runs: $((SECONDS - start)) s"
"$bin" report --ablation "$out" --warmup "$warmup"
cat "$out/table.md"
if [ "${UPDATE_DOCS:-0}" = 1 ]; then cp "$out/ablation.svg" docs/ablation.svg; fi
