#!/usr/bin/env bash
# Node A (rollout, 8 GPUs): Ray head + the Mooncake master. Run inside the image.
#   MOONCAKE_DEVICE=mlx5_0 bash scripts/start_head.sh <this node's IP>
set -euo pipefail
ip=${1:?usage: start_head.sh <this node IP>}
: "${MOONCAKE_DEVICE:?export MOONCAKE_DEVICE (e.g. mlx5_0) before Ray starts}"
export MOONCAKE_MASTER="$ip:50051" MOONCAKE_METADATA_SERVER="http://$ip:8080/metadata"
nohup python -m transfer.data.mooncake_master --host "$ip" --log mooncake_master.log \
    > mooncake_master.out 2>&1 &
echo "mooncake_master pid $!"
# exported before `ray start`, so every Ray worker on this node inherits them
ray start --head --node-ip-address="$ip" --port=6379 --resources='{"rollout_node": 1}'
echo "On node B: MOONCAKE_DEVICE=<its device> bash scripts/start_worker.sh $ip <node B IP>"
