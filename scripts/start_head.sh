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
# exported before `ray start`, so every Ray worker on this node inherits them.
# The dashboard serves the job API (`ray job submit`); Ray binds it to 127.0.0.1 unless told
# otherwise, which refuses submissions from any other machine. It has no authentication:
# keep port 8265 inside the cluster's network.
ray start --head --node-ip-address="$ip" --port=6379 --resources='{"rollout_node": 1}' \
    --dashboard-host=0.0.0.0 --dashboard-port=8265
echo "On node B: MOONCAKE_DEVICE=<its device> bash scripts/start_worker.sh $ip <node B IP>"
echo "Submit jobs from any node: ray job submit --address http://$ip:8265 --working-dir . -- python train.py ..."
