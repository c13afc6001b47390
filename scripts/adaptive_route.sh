#!/usr/bin/env bash
# The adaptive route of the expert all-to-all (docs/parallel.md) with a link change in the middle
# of a run: trains configs/ablation/model.toml by 4 MPI processes as 2 nodes of 2 (the network
# namespaces of scripts/two_nodes.sh) with dist.adaptive_route, on a rail-optimised network: the
# ranks of the same local index talk over their own rail, ranks of different local indices over
# the spine, each at RATE. Once CHANGE_STEP steps are done the spine's rate drops to RATE2 on both
# ends (`tc class change`). The direct route crosses the spine, the 2-D route (within the node,
# then along the rails) does not, so the route should move to the 2-D path and the step time
# recover. Prints per step the path taken (0 direct, 1 relayed through the 2-D route), whether it
# was a probe, the step time and both paths' moving averages (from metrics.jsonl), then the bytes
# each class carried before and after the change.
#
#   scripts/adaptive_route.sh [BUILD_DIR]     as root for the namespaces; about a minute
#
# Environment: RATE=1gbit DELAY= (every class at the start), RATE2=10mbit (the spine after the
# change), STEPS=60 CHANGE_STEP=25 PROBE=5 (dist.route_probe_every), START=flat|hierarchical
# (the path before anything is measured), OUT=out/adaptive_route, NETNS=auto|off.
set -euo pipefail
build=${1:-build}
bin="$build/moetrain"
config=configs/ablation/model.toml
out=${OUT:-out/adaptive_route}
rate=${RATE:-1gbit} delay=${DELAY:-}
rate2=${RATE2:-10mbit}
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

rails=1
# shellcheck source=scripts/two_nodes.sh
. "$(dirname "$0")/two_nodes.sh"
[ "$mode" = netns ] || echo "adaptive_route.sh: no link to change ($why): the route runs, the change is skipped" >&2

# class_bytes: "NAME BYTES" for the rails, the spine and the traffic within nodes, summed over
# the fabric's ports.
class_bytes() {
  local c total p n dev
  for c in 10:rails 20:spine 30:within_nodes; do
    total=0
    for p in "${rail_ports[@]}"; do
      IFS=: read -r n dev _ <<< "$p"
      total=$((total + $(ip netns exec "$n" tc -s class show dev "$dev" classid "1:${c%%:*}" |
        awk '/Sent/ { print $2; exit }')))
    done
    echo "${c#*:} $total"
  done
}
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
    class_bytes > "$out/classes_before.txt"
    for p in "${rail_ports[@]}"; do
      IFS=: read -r n dev _ <<< "$p"
      ip netns exec "$n" tc class change dev "$dev" parent 1: classid 1:20 htb rate "$rate2" \
        burst 256kb
    done
    echo "== after step $done_steps: the spine changed to rate $rate2" | tee "$out/change.txt"
  fi
done
if ! wait "$child"; then
  child=0
  tail -20 "$out/log.txt" >&2
  die "the run failed (log: $out/log.txt)"
fi
child=0
grep -h "all-to-all now goes" "$out/log.txt" || true
if [ "$mode" = netns ] && [ -f "$out/classes_before.txt" ]; then
  class_bytes > "$out/classes_after.txt"
  echo "bytes carried, before the change / after it:"
  paste "$out/classes_before.txt" "$out/classes_after.txt" |
    awk '{ printf "  %-12s %12d / %12d\n", $1, $2, $4 - $2 }'
fi
echo "step  route  probe  step_time_s  direct_ms  relayed_ms"
jq -r 'select(.step_time_s != null) | [.step, .a2a_route, .a2a_route_probe, .step_time_s,
  (.a2a_route_direct_s * 1000), (.a2a_route_relayed_s * 1000)] |
  "\(.[0])  \(.[1])  \(.[2])  \(.[3] * 1000 | round / 1000)  \(.[4] * 100 | round / 100)  \(.[5] * 100 | round / 100)"' \
  "$metrics" | column -t
