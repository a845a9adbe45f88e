#!/usr/bin/env bash
# Node B (training): joins the head's Ray cluster with the `train_node` resource.
#   bash scripts/start_worker.sh <head IP> <this node's IP>                            # TCP
#   MOONCAKE_PROTOCOL=rdma MOONCAKE_DEVICE=mlx5_0 bash scripts/start_worker.sh <head IP> <this node's IP>
# Stop with `bash scripts/stop_node.sh <this node's IP>`.
set -euo pipefail
head=${1:?usage: start_worker.sh <head IP> <this node IP>}
ip=${2:?usage: start_worker.sh <head IP> <this node IP>}
cd "$(dirname "$0")/.."
source scripts/node_env.sh
node_env "$head" "$ip"  # the master runs on the head
# A node that is not the head takes the head's temp dir unless told: honour this node's RAY_TMPDIR
# (two nodes on one machine, as the rehearsal runs them, must not share one).
ray start --address="$head:6379" --node-ip-address="$ip" --resources='{"train_node": 1}' \
    --disable-usage-stats ${RAY_TMPDIR:+--temp-dir="$RAY_TMPDIR/ray"}
echo "Joined $head:6379 as $ip (train_node, protocol $MOONCAKE_PROTOCOL)"
