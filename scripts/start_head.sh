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
source scripts/node_env.sh
node_env "$ip" "$ip"  # this node hosts the master
# The master first: the first job's clients connect to it as soon as they start.
nohup python -m transfer.data.mooncake.master --host "$ip" --log "$state/mooncake_master.log" \
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
