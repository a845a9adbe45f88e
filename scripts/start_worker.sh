#!/usr/bin/env bash
# Node B (training, 8 GPUs): joins the head's Ray cluster. Run inside the image.
#   MOONCAKE_DEVICE=mlx5_0 bash scripts/start_worker.sh <head IP> <this node's IP>
set -euo pipefail
head=${1:?usage: start_worker.sh <head IP> <this node IP>}
ip=${2:?usage: start_worker.sh <head IP> <this node IP>}
: "${MOONCAKE_DEVICE:?export MOONCAKE_DEVICE (e.g. mlx5_0) before Ray starts}"
export MOONCAKE_MASTER="$head:50051" MOONCAKE_METADATA_SERVER="http://$head:8080/metadata"
ray start --address="$head:6379" --node-ip-address="$ip" --resources='{"train_node": 1}'
