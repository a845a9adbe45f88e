# Sourced by start_head.sh and start_worker.sh: what every node exports before `ray start`
# (Ray workers inherit it). Usage: node_env <master node IP> <this node's IP>
node_env() {
    local master=$1 ip=$2 ifname
    export MOONCAKE_PROTOCOL=${MOONCAKE_PROTOCOL:-tcp}
    if [ "$MOONCAKE_PROTOCOL" = rdma ]; then
        : "${MOONCAKE_DEVICE:?MOONCAKE_PROTOCOL=rdma: export MOONCAKE_DEVICE (e.g. mlx5_0) before Ray starts}"
    fi
    # The hostname each Mooncake client announces is this node's address, never a loopback
    # one: the other node's clients write to and read from it.
    export MOONCAKE_MASTER="$master:50051" MOONCAKE_METADATA_SERVER="http://$master:8080/metadata"
    export MOONCAKE_LOCAL_HOSTNAME=${MOONCAKE_LOCAL_HOSTNAME:-$ip}
    # gloo (CPU weight sync) and NCCL bind to the interface of the machine's hostname unless
    # told; on a node with several interfaces that may be one the other node cannot reach
    # (measured in the rehearsal: the first weight sync hung). Pin them to the one holding $ip.
    ifname=$(ip -o -4 addr show | awk -v ip="$ip" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -n1)
    : "${ifname:?no interface holds $ip on this node: pass the address of this node}"
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
}
