"""Checks of the Ray cluster against the placement a run asks for, before any worker starts.

Ray itself waits for a placement group it cannot place, then times out with a list of
bundles; these checks name the node or resource that is missing and the command that adds it.
``nodes`` is what ``ray.nodes()`` returns (``Alive``, ``NodeManagerAddress``, ``Resources``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl.config.cluster import ClusterConfig


def check_nodes(c: ClusterConfig, nodes: list[dict[str, Any]]) -> None:
    """Raise ``ValueError`` when the alive nodes cannot hold the placement of ``c``."""
    alive = [n for n in nodes if n.get("Alive")]
    seen = describe_nodes(alive)
    if len(alive) < c.min_nodes:
        raise ValueError(
            f"cluster={c.name} needs {c.min_nodes} Ray nodes but the Ray cluster has {len(alive)} "
            f"({seen}): start the others with `bash scripts/start_worker.sh <head IP> <node IP>` "
            "(docs/quickstart-two-node.md), or use cluster=local on one machine")
    pools = {}
    for what, field, resource, count, gpus in (
            ("rollout", "engine_resource", c.engine_resource, c.num_engines, c.gpus_per_engine),
            ("training", "learner_resource", c.learner_resource, c.num_learners, c.gpus_per_learner)):
        holders = [n for n in alive if resource is None or n["Resources"].get(resource, 0) > 0]
        if not holders:
            flag = json.dumps({resource: 1})
            raise ValueError(
                f"no Ray node has the resource '{resource}' that cluster.{field} pins the {what} "
                f"pool to ({seen}): start the {what} node with `ray start ... "
                f"--resources='{flag}'` (scripts/start_head.sh gives the head 'rollout_node', "
                "scripts/start_worker.sh gives workers 'train_node')")
        have = sum(n["Resources"].get("GPU", 0) for n in holders)
        if gpus and have < count * gpus:
            raise ValueError(
                f"the {what} pool needs {count} x {gpus} GPUs but the nodes with "
                f"'{resource or 'any'}' have {have:g} ({seen}): lower cluster.num_"
                f"{'engines' if what == 'rollout' else 'learners'} or add nodes")
        pools[what] = {n["NodeManagerAddress"] for n in holders}
    if c.min_nodes > 1 and len(pools["rollout"] | pools["training"]) < 2:
        raise ValueError(
            f"cluster={c.name} places the rollout and training pools on different nodes, but only "
            f"{sorted(pools['rollout'] | pools['training'])} can hold them ({seen}): `ray start` each node "
            "with one of the two resources (scripts/start_head.sh, scripts/start_worker.sh)")


def describe_nodes(nodes: list[dict[str, Any]]) -> str:
    """``10.0.0.1 ['rollout_node'], 10.0.0.2 ['train_node']``: each node with its custom
    resources (not the ``*_group_*`` ones placement groups add)."""
    def custom(n: dict[str, Any]) -> list[str]:
        return sorted(k for k in n["Resources"] if k not in ("CPU", "GPU", "memory", "object_store_memory")
                      and not k.startswith(("node:", "accelerator_type:")) and "_group_" not in k)

    return ", ".join(f"{n['NodeManagerAddress']} {custom(n)}" for n in nodes) or "no nodes"


def node_environments(names: tuple[str, ...], timeout_s: float = 60) -> dict[str, dict[str, str]]:
    """Each alive node's values of the environment variables ``names``, as Ray workers there
    see them (exported before ``ray start``, or set by the job): node address -> values."""
    @ray.remote(num_cpus=0)
    def read(keys: tuple[str, ...]) -> dict[str, str]:
        return {k: os.environ[k] for k in keys if k in os.environ}

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(names) for n in nodes]
    return dict(zip([n["NodeManagerAddress"] for n in nodes], ray.get(refs, timeout=timeout_s)))
