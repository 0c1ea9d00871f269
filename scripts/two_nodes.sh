# Sourced by the slow-link benchmarks: two "nodes", network namespaces joined by a veth pair, with a
# token-bucket rate limit on both ends (these kernels have no netem). Needs root.
#   two_nodes RATE SUBNET   makes them and sets NS0 NS1 (the namespaces) and DEV0 DEV1 (their ends of
#                           the pair); node k has address SUBNET.(k+1); an EXIT trap removes them
#   remove_two_nodes        kills what runs in them and removes them (the trap's; call it from your own)
two_nodes() {
    local rate=$1 subnet=$2
    NS0=tt-node0-$$ NS1=tt-node1-$$ DEV0=tt0-$$ DEV1=tt1-$$
    trap remove_two_nodes EXIT
    ip netns add "$NS0"; ip netns add "$NS1"
    ip link add "$DEV0" type veth peer name "$DEV1"
    ip link set "$DEV0" netns "$NS0"; ip link set "$DEV1" netns "$NS1"
    ip -n "$NS0" addr add "$subnet.1/24" dev "$DEV0"; ip -n "$NS1" addr add "$subnet.2/24" dev "$DEV1"
    for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
    ip -n "$NS0" link set "$DEV0" up; ip -n "$NS1" link set "$DEV1" up
    tc -n "$NS0" qdisc add dev "$DEV0" root tbf rate "$rate" burst 256kb latency 50ms
    tc -n "$NS1" qdisc add dev "$DEV1" root tbf rate "$rate" burst 256kb latency 50ms
}

remove_two_nodes() {
    for ns in "$NS0" "$NS1"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true  # takes its end of the veth pair with it
    done
}
