# The emulated nodes of scripts/ablation.sh and scripts/adaptive_route.sh, sourced by them, and
# `launch`, the mpirun command line that runs 4 ranks as 2 nodes of 2 there. Two layouts:
# - default: two network namespaces (mt-node0, mt-node1) joined by a veth pair whose both ends are
#   rate-limited with tc (tbf at $rate, handle 2:, under a netem $delay, handle 1:, where the
#   kernel has netem). Within a node the ranks talk over Open MPI's shared memory (vader).
# - rails=1 (set by the sourcing script): a rail-optimised fabric. Each rank has its own namespace
#   (mt-rank0..3; ranks 0, 1 form node 0 and 2, 3 node 1, as dist.ranks_per_node = 2 says) with
#   one address on a bridge in mt-fabric, and every bridge port's egress (the traffic to its rank)
#   is shaped by where the packet comes from: 1:30 the same node (unshaped, 100gbit), 1:10 the
#   rank's rail (the other node's rank of the same local index) and 1:20 the spine (the other
#   node's rank of the other local index), both at $rate (under a netem $delay where given).
#   rail_ports lists the ports as "NAMESPACE:DEVICE:LOCAL_INDEX"; `tc class change` of classid
#   1:20 on each changes the spine. The direct all-to-all crosses the spine; the 2-D route (within
#   the node, then along the rails) does not.
# Without root or `ip netns` (or NETNS=off) all 4 ranks run on this host over loopback.
# Needs from the sourcing script: rate, delay, die; sets tmp, mode, why, link, launch, child,
# rail_ports, and the EXIT/INT/TERM traps that remove the namespaces and stop a run waited for in
# the background (its pid in child).
rails=${rails:-0} fabric=mt-fabric rail_ports=()
if [ "$rails" = 1 ]; then
  net=10.231.78 hosts=(mt-rank0 mt-rank1 mt-rank2 mt-rank3) slots=1
  ips=("$net.1" "$net.2" "$net.3" "$net.4")
else
  net=10.231.77 hosts=(mt-node0 mt-node1) slots=2 ips=("$net.1" "$net.2")
  veth0=mt-veth0 veth1=mt-veth1
fi
tmp=$(mktemp -d)
created=0
cleanup() {
  if [ "$created" = 1 ]; then
    for n in "${hosts[@]}" $([ "$rails" = 1 ] && echo "$fabric"); do
      ip netns del "$n" 2> /dev/null || true
    done
  fi
  rm -rf "$tmp"
}
# A run is waited for in the background, so that Ctrl-C or a TERM reaches this shell at once: it
# stops mpirun (which stops its job), then the EXIT trap removes the namespaces.
child=0
on_signal() {
  if [ "$child" != 0 ]; then
    kill -TERM "$child" 2> /dev/null || true
    wait "$child" 2> /dev/null || true
  fi
  exit 130
}
trap cleanup EXIT
trap on_signal INT TERM

# make_pair: the default layout's two namespaces and their veth pair.
make_pair() {
  ip netns add "${hosts[0]}" && ip netns add "${hosts[1]}" &&
    ip link add "$veth0" type veth peer name "$veth1" &&
    ip link set "$veth0" netns "${hosts[0]}" && ip link set "$veth1" netns "${hosts[1]}" &&
    ip -n "${hosts[0]}" addr add "${ips[0]}/24" dev "$veth0" &&
    ip -n "${hosts[1]}" addr add "${ips[1]}/24" dev "$veth1" &&
    ip -n "${hosts[0]}" link set lo up && ip -n "${hosts[1]}" link set lo up &&
    ip -n "${hosts[0]}" link set "$veth0" up && ip -n "${hosts[1]}" link set "$veth1" up
}
# make_fabric: rails=1's namespaces, bridge and ports (unshaped; shape_fabric shapes them).
make_fabric() {
  local k
  ip netns add "$fabric" && ip -n "$fabric" link set lo up &&
    ip -n "$fabric" link add mt-br type bridge && ip -n "$fabric" link set mt-br up || return 1
  for k in 0 1 2 3; do
    ip netns add "${hosts[k]}" && ip -n "${hosts[k]}" link set lo up &&
      ip -n "${hosts[k]}" link add mt-eth type veth peer name "mt-port$k" netns "$fabric" &&
      ip -n "${hosts[k]}" addr add "${ips[k]}/24" dev mt-eth &&
      ip -n "${hosts[k]}" link set mt-eth up &&
      ip -n "$fabric" link set "mt-port$k" master mt-br && ip -n "$fabric" link set "mt-port$k" up ||
      return 1
  done
}

mode=loopback why=""
if [ "${NETNS:-auto}" = off ]; then
  why="NETNS=off"
elif [ "$(id -u)" != 0 ]; then
  why="not root"
elif ! ip netns list > /dev/null 2>&1; then
  why="\`ip netns\` is unavailable"
else
  for n in "${hosts[@]}" $([ "$rails" = 1 ] && echo "$fabric"); do
    if ip netns list | awk '{print $1}' | grep -qx "$n"; then
      die "network namespace $n exists already (another ablation run, or someone else's):" \
        "remove it with \`ip netns del $n\` once nothing uses it"
    fi
  done
  created=1
  if { [ "$rails" = 1 ] && make_fabric; } || { [ "$rails" != 1 ] && make_pair; }; then
    mode=netns
  else
    why="creating the namespaces and their links failed"
  fi
fi
link="loopback, no rate limit"
if [ "$mode" = netns ] && [ "$rails" = 1 ]; then
  for k in 0 1 2 3; do
    port=mt-port$k
    mate=$((k ^ 1)) rail=$(((k + 2) % 4)) spine=$(((k + 2) % 4 ^ 1))
    ip netns exec "$fabric" tc qdisc add dev "$port" root handle 1: htb default 30 r2q 1000 &&
      ip netns exec "$fabric" tc class add dev "$port" parent 1: classid 1:30 htb rate 100gbit \
        quantum 60000 &&
      ip netns exec "$fabric" tc class add dev "$port" parent 1: classid 1:10 htb rate "$rate" \
        burst 256kb &&
      ip netns exec "$fabric" tc class add dev "$port" parent 1: classid 1:20 htb rate "$rate" \
        burst 256kb || die "tc could not shape $port in $fabric at $rate"
    for c in "$mate:30" "$rail:10" "$spine:20"; do
      ip netns exec "$fabric" tc filter add dev "$port" parent 1: protocol ip prio 1 u32 \
        match ip src "${ips[${c%%:*}]}/32" flowid "1:${c#*:}" ||
        die "tc could not add a filter to $port in $fabric"
    done
    if [ -n "$delay" ]; then
      ip netns exec "$fabric" tc qdisc add dev "$port" parent 1:10 netem delay "$delay" &&
        ip netns exec "$fabric" tc qdisc add dev "$port" parent 1:20 netem delay "$delay" ||
        die "tc netem is unavailable here: DELAY=$delay cannot be applied"
    fi
    rail_ports+=("$fabric:$port:$((k % 2))")
  done
  link="two rails and a spine at $rate each"
  [ -n "$delay" ] && link="$link, delay $delay"
elif [ "$mode" = netns ]; then
  link="veth $rate"
  for pair in "${hosts[0]}:$veth0" "${hosts[1]}:$veth1"; do
    n=${pair%%:*} dev=${pair#*:} parent=root
    if [ -n "$delay" ]; then
      if ip netns exec "$n" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" 2> /dev/null
      then
        parent="parent 1:"
      else
        echo "${0##*/}: tc netem is unavailable here: DELAY=$delay is not applied" >&2
        delay=""
      fi
    fi
    # shellcheck disable=SC2086
    ip netns exec "$n" tc qdisc add dev "$dev" $parent handle 2: tbf rate "$rate" burst 256kb \
      latency 100ms || die "tc could not limit $dev in $n to $rate"
  done
  [ -n "$delay" ] && link="$link, delay $delay"
fi
if [ "$mode" = netns ]; then
  # mpirun's rsh agent: "HOST COMMAND..." → the command inside HOST's namespace.
  {
    echo '#!/usr/bin/env bash'
    echo 'host=$1; shift'
    echo 'case $host in'
    for k in "${!hosts[@]}"; do echo "  ${ips[k]}) ns=${hosts[k]} ;;"; done
    echo '  *) echo "netns_rsh: unknown host $host" >&2; exit 1 ;;'
    echo 'esac'
    echo 'exec ip netns exec "$ns" unshare --uts bash -c "hostname $ns && $*"'
  } > "$tmp/netns_rsh"
  chmod +x "$tmp/netns_rsh"
  for ip in "${ips[@]}"; do echo "$ip slots=$slots"; done > "$tmp/hosts"
  launch=(ip netns exec "${hosts[0]}" unshare --uts bash -c "hostname ${hosts[0]} && exec \"\$@\"" _
    mpirun -n 4 --hostfile "$tmp/hosts" --map-by slot
    --mca plm_rsh_agent "$tmp/netns_rsh" --mca oob_tcp_if_include "$net.0/24"
    --mca btl self,vader,tcp --mca btl_tcp_if_include "$net.0/24")
else
  echo "${0##*/}: no network namespaces ($why): all 4 ranks on this host over loopback" >&2
  launch=(mpirun -n 4 --oversubscribe --mca btl self,vader,tcp)
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch+=(--bind-to none -x OMP_NUM_THREADS=1 -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM)
