#!/usr/bin/env bash
# Node A (rollout): the Mooncake master, then the Ray head with the `rollout_node` resource.
#   bash scripts/start_head.sh <this node's IP>                                        # TCP
#   MOONCAKE_PROTOCOL=rdma MOONCAKE_DEVICE=mlx5_0 bash scripts/start_head.sh <this node's IP>
# Stop with `bash scripts/stop_node.sh <this node's IP>`. Logs and the master's pid go to
# /tmp/rl-node-<IP> (RL_NODE_DIR overrides).
set -euo pipefail
ip=${1:?usage: start_head.sh <this node IP>}
cd "$(dirname "$0")/.."
state=${RL_NODE_DIR:-/tmp/rl-node-$ip}
mkdir -p "$state"
export MOONCAKE_PROTOCOL=${MOONCAKE_PROTOCOL:-tcp}
if [ "$MOONCAKE_PROTOCOL" = rdma ]; then
    : "${MOONCAKE_DEVICE:?MOONCAKE_PROTOCOL=rdma: export MOONCAKE_DEVICE (e.g. mlx5_0) before Ray starts}"
fi
# Exported before `ray start`, so every Ray worker on this node inherits them. The hostname
# each Mooncake client announces is this node's address, never a loopback one.
export MOONCAKE_MASTER="$ip:50051" MOONCAKE_METADATA_SERVER="http://$ip:8080/metadata"
export MOONCAKE_LOCAL_HOSTNAME=${MOONCAKE_LOCAL_HOSTNAME:-$ip}
# gloo (CPU weight sync) and NCCL bind to the interface of the machine's hostname unless told;
# on a node with several interfaces that may be one the other node cannot reach (measured in
# the rehearsal: the first weight sync hung). Pin them to the interface holding $ip.
ifname=$(ip -o -4 addr show | awk -v ip="$ip" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -n1)
: "${ifname:?no interface holds $ip on this node: pass the address of this node}"
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
# The master first: the first job's clients connect to it as soon as they start.
nohup python -m transfer.data.mooncake_master --host "$ip" --log "$state/mooncake_master.log" \
    > "$state/mooncake_master.out" 2>&1 &
echo $! > "$state/mooncake_master.pid"
for _ in $(seq 150); do  # the launcher prints "Serving" once the master answers
    grep -q Serving "$state/mooncake_master.out" && break
    kill -0 "$(cat "$state/mooncake_master.pid")" 2>/dev/null || { cat "$state/mooncake_master.out"; exit 1; }
    sleep 0.2
done
grep -q Serving "$state/mooncake_master.out" || { echo "mooncake_master not ready after 30 s" >&2; exit 1; }
echo "mooncake_master at $MOONCAKE_MASTER (pid $(cat "$state/mooncake_master.pid")), protocol $MOONCAKE_PROTOCOL"
# The dashboard serves the job API (`ray job submit`); Ray binds it to 127.0.0.1 unless told
# otherwise, which refuses submissions from any other machine. It has no authentication:
# keep port 8265 inside the cluster's network.
ray start --head --node-ip-address="$ip" --port=6379 --resources='{"rollout_node": 1}' \
    --dashboard-host=0.0.0.0 --dashboard-port=8265 --disable-usage-stats
echo "On node B: bash scripts/start_worker.sh $ip <node B IP>   (same MOONCAKE_PROTOCOL/MOONCAKE_DEVICE)"
echo "Submit jobs from any node: ray job submit --address http://$ip:8265 --working-dir . -- python train.py ..."
