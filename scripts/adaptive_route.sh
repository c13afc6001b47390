#!/usr/bin/env bash
# The adaptive route of the expert all-to-all (docs/parallel.md) with a link change in the middle
# of a run: trains configs/ablation/model.toml by 4 MPI processes as 2 nodes of 2 (the network
# namespaces of scripts/two_nodes.sh, as scripts/ablation.sh) with dist.adaptive_route, and once
# CHANGE_STEP steps are done changes the inter-node link on both ends with `tc qdisc change`
# (tbf rate RATE2, and netem delay DELAY2 where DELAY gave the link a netem). Prints per step
# the path taken (0 direct, 1 relayed through the 2-D route), whether it was a probe, the step
# time and both paths' moving averages, from metrics.jsonl.
#
#   scripts/adaptive_route.sh [BUILD_DIR]     as root for the namespaces; about a minute
#
# Environment: RATE=1gbit DELAY= (the link at the start), RATE2=20mbit DELAY2= (after the
# change), STEPS=60 CHANGE_STEP=25 PROBE=5 (dist.route_probe_every), START=flat|hierarchical
# (the path before anything is measured), OUT=out/adaptive_route, NETNS=auto|off.
set -euo pipefail
build=${1:-build}
bin="$build/moetrain"
config=configs/ablation/model.toml
out=${OUT:-out/adaptive_route}
rate=${RATE:-1gbit} delay=${DELAY:-}
rate2=${RATE2:-20mbit} delay2=${DELAY2:-}
steps=${STEPS:-60} change_step=${CHANGE_STEP:-25} probe=${PROBE:-5} start=${START:-flat}

die() { echo "adaptive_route.sh: $*" >&2; exit 1; }
[ -x "$bin" ] || die "$bin not found: run \`make build\` first (or pass the build folder)"
[ -f "$config" ] || die "run from the repository root ($config)"
command -v mpirun > /dev/null || die "mpirun not found (Open MPI)"
command -v jq > /dev/null || die "jq not found (it reads metrics.jsonl)"
[ "$start" = flat ] || [ "$start" = hierarchical ] || die "START=$start: allowed are flat, hierarchical"
[ "$change_step" -lt "$steps" ] || die "CHANGE_STEP=$change_step must be below STEPS=$steps"
if [ ! -f data/fortunes/train.bin ] || [ ! -f data/fortunes/val.bin ]; then
  "$bin" prepare --input /usr/share/games/fortunes --out data/fortunes
fi

# shellcheck source=scripts/two_nodes.sh
. "$(dirname "$0")/two_nodes.sh"
[ "$mode" = netns ] || echo "adaptive_route.sh: no link to change ($why): the route runs, the change is skipped" >&2

rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)  # given to processes in the other namespace
metrics="$out/run/metrics.jsonl"
echo "== $mode ($link), 4 ranks as 2 nodes of 2, $(nproc) cores; $steps steps, change after step $change_step"
"${launch[@]}" "$bin" train --config "$config" --set dist.adaptive_route=true \
  --set dist.ranks_per_node=2 --set dist.hierarchical=$([ "$start" = hierarchical ] && echo true || echo false) \
  --set dist.route_probe_every="$probe" --set train.steps="$steps" \
  --set train.run_dir="$out/run" > "$out/log.txt" 2>&1 &
child=$!
changed=0
while kill -0 "$child" 2> /dev/null; do
  sleep 0.2
  [ "$changed" = 0 ] || continue
  done_steps=$(grep -c '"step_time_s"' "$metrics" 2> /dev/null || true)
  [ "${done_steps:-0}" -ge "$change_step" ] || continue
  changed=1
  if [ "$mode" = netns ]; then
    for pair in "$ns0:$veth0" "$ns1:$veth1"; do
      n=${pair%%:*} dev=${pair#*:}
      if [ -n "$delay2" ] && [ "$tc_parent" != root ]; then
        ip netns exec "$n" tc qdisc change dev "$dev" root handle 1: netem delay "$delay2"
      fi
      # shellcheck disable=SC2086
      ip netns exec "$n" tc qdisc change dev "$dev" $tc_parent handle 2: tbf rate "$rate2" \
        burst 256kb latency 100ms
    done
    echo "== after step $done_steps: link changed to rate $rate2$([ -n "$delay2" ] && echo ", delay $delay2")" |
      tee "$out/change.txt"
  fi
done
if ! wait "$child"; then
  child=0
  tail -20 "$out/log.txt" >&2
  die "the run failed (log: $out/log.txt)"
fi
child=0
grep -h "all-to-all now goes" "$out/log.txt" || true
echo "step  route  probe  step_time_s  direct_ms  relayed_ms"
jq -r 'select(.step_time_s != null) | [.step, .a2a_route, .a2a_route_probe, .step_time_s,
  (.a2a_route_direct_s * 1000), (.a2a_route_relayed_s * 1000)] |
  "\(.[0])  \(.[1])  \(.[2])  \(.[3] * 1000 | round / 1000)  \(.[4] * 100 | round / 100)  \(.[5] * 100 | round / 100)"' \
  "$metrics" | column -t
