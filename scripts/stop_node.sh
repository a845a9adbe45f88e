#!/usr/bin/env bash
# Stops what start_head.sh or start_worker.sh started on this node: Ray (its jobs, actors
# and engine servers with it), then the Mooncake master when this node runs one.
#   bash scripts/stop_node.sh <this node's IP>
set -euo pipefail
ip=${1:?usage: stop_node.sh <this node IP>}
state=${RL_NODE_DIR:-/tmp/rl-node-$ip}
ray stop --force
pidfile="$state/mooncake_master.pid"
if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile")
    # the launcher stops its mooncake_master child on SIGINT (and the child dies with it)
    kill -INT "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    echo "mooncake_master (pid $pid) stopped"
fi
