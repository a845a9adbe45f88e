#!/usr/bin/env bash
# Node B (training): joins the head's Ray cluster with the `train_node` resource.
#   bash scripts/start_worker.sh <head IP> <this node's IP>                            # TCP
#   MOONCAKE_PROTOCOL=rdma MOONCAKE_DEVICE=mlx5_0 bash scripts/start_worker.sh <head IP> <this node's IP>
# Stop with `bash scripts/stop_node.sh <this node's IP>`.
set -euo pipefail
head=${1:?usage: start_worker.sh <head IP> <this node IP>}
ip=${2:?usage: start_worker.sh <head IP> <this node IP>}
cd "$(dirname "$0")/.."
export MOONCAKE_PROTOCOL=${MOONCAKE_PROTOCOL:-tcp}
if [ "$MOONCAKE_PROTOCOL" = rdma ]; then
    : "${MOONCAKE_DEVICE:?MOONCAKE_PROTOCOL=rdma: export MOONCAKE_DEVICE (e.g. mlx5_0) before Ray starts}"
fi
# Exported before `ray start` (Ray workers inherit them); the learners' segments are
# announced at this node's address, which node A's clients write to.
export MOONCAKE_MASTER="$head:50051" MOONCAKE_METADATA_SERVER="http://$head:8080/metadata"
export MOONCAKE_LOCAL_HOSTNAME=${MOONCAKE_LOCAL_HOSTNAME:-$ip}
# gloo (CPU weight sync) and NCCL bind to the interface of the machine's hostname unless told;
# on a node with several interfaces that may be one the other node cannot reach (measured in
# the rehearsal: the first weight sync hung). Pin them to the interface holding $ip.
ifname=$(ip -o -4 addr show | awk -v ip="$ip" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -n1)
: "${ifname:?no interface holds $ip on this node: pass the address of this node}"
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
ray start --address="$head:6379" --node-ip-address="$ip" --resources='{"train_node": 1}' \
    --disable-usage-stats
echo "Joined $head:6379 as $ip (train_node, protocol $MOONCAKE_PROTOCOL)"
