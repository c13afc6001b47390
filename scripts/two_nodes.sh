# The two emulated nodes of scripts/ablation.sh and scripts/adaptive_route.sh, sourced by them:
# two network namespaces (mt-node0, mt-node1) joined by a veth pair whose both ends are
# rate-limited with tc (tbf at $rate, handle 2:, under a netem $delay, handle 1:, where the kernel
# has netem), and `launch`, the mpirun command line that runs 4 ranks as 2 nodes of 2 there.
# Without root or `ip netns` (or NETNS=off) all 4 ranks run on this host over loopback.
# Needs from the sourcing script: rate, delay, die; sets tmp, mode, why, link, launch, child,
# tc_parent (the tbf's parent, for `tc qdisc change`), and the EXIT/INT/TERM traps that remove the
# namespaces and stop a run waited for in the background (its pid in child).
ns0=mt-node0 ns1=mt-node1 veth0=mt-veth0 veth1=mt-veth1
net=10.231.77 ip0=10.231.77.1 ip1=10.231.77.2
tmp=$(mktemp -d)
created=0
cleanup() {
  if [ "$created" = 1 ]; then
    ip netns del "$ns0" 2> /dev/null || true
    ip netns del "$ns1" 2> /dev/null || true
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

mode=loopback why="" tc_parent=root
if [ "${NETNS:-auto}" = off ]; then
  why="NETNS=off"
elif [ "$(id -u)" != 0 ]; then
  why="not root"
elif ! ip netns list > /dev/null 2>&1; then
  why="\`ip netns\` is unavailable"
else
  for n in "$ns0" "$ns1"; do
    if ip netns list | awk '{print $1}' | grep -qx "$n"; then
      die "network namespace $n exists already (another ablation run, or someone else's):" \
        "remove it with \`ip netns del $n\` once nothing uses it"
    fi
  done
  created=1
  if ip netns add "$ns0" && ip netns add "$ns1" &&
    ip link add "$veth0" type veth peer name "$veth1" &&
    ip link set "$veth0" netns "$ns0" && ip link set "$veth1" netns "$ns1" &&
    ip -n "$ns0" addr add "$ip0/24" dev "$veth0" && ip -n "$ns1" addr add "$ip1/24" dev "$veth1" &&
    ip -n "$ns0" link set lo up && ip -n "$ns1" link set lo up &&
    ip -n "$ns0" link set "$veth0" up && ip -n "$ns1" link set "$veth1" up; then
    mode=netns
  else
    why="creating the namespaces and their veth pair failed"
  fi
fi
link="loopback, no rate limit"
if [ "$mode" = netns ]; then
  link="veth $rate"
  for pair in "$ns0:$veth0" "$ns1:$veth1"; do
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
  tc_parent=$parent
  [ -n "$delay" ] && link="$link, delay $delay"
  # mpirun's rsh agent: "HOST COMMAND..." → the command inside HOST's namespace.
  cat > "$tmp/netns_rsh" << EOF
#!/usr/bin/env bash
host=\$1; shift
case \$host in $ip0) ns=$ns0 ;; $ip1) ns=$ns1 ;; *) echo "netns_rsh: unknown host \$host" >&2; exit 1 ;; esac
exec ip netns exec "\$ns" unshare --uts bash -c "hostname \$ns && \$*"
EOF
  chmod +x "$tmp/netns_rsh"
  printf '%s slots=2\n%s slots=2\n' "$ip0" "$ip1" > "$tmp/hosts"
  launch=(ip netns exec "$ns0" unshare --uts bash -c "hostname $ns0 && exec \"\$@\"" _
    mpirun -n 4 --hostfile "$tmp/hosts" --map-by slot
    --mca plm_rsh_agent "$tmp/netns_rsh" --mca oob_tcp_if_include "$net.0/24"
    --mca btl self,vader,tcp --mca btl_tcp_if_include "$net.0/24")
else
  echo "${0##*/}: no network namespaces ($why): all 4 ranks on this host over loopback" >&2
  launch=(mpirun -n 4 --oversubscribe --mca btl self,vader,tcp)
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch+=(--bind-to none -x OMP_NUM_THREADS=1 -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM)
