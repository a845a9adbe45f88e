"""The GPU configurations compose, place 8 + 8 GPUs on two nodes, and the two-node
quickstart's commands are real: every script exists, every override composes."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from rl.driver.placement import bundle, describe_placement
from rl.rollout.engines.commands import server_command
from tests.support.docs import doc_commands
from tests.support.env import REPO, compose


@pytest.mark.parametrize("transfer", ["mooncake_rdma", "mooncake_tcp", "ray"])
@pytest.mark.parametrize("weights", ["p2p", "broadcast"])
def test_two_node_gpu_combinations_compose(transfer, weights):
    cfg = compose("cluster=two_node_8x8", "rollout=sglang", "model.dtype=bfloat16", f"transfer={transfer}",
                  f"weights={weights}")
    plan = describe_placement(cfg)
    assert "8 sglang engines x 1 GPU on nodes with resource 'rollout_node' (8 GPUs)" in plan
    assert "8 learner ranks x 1 GPU on nodes with resource 'train_node' (8 GPUs)" in plan
    # the bundles pin each pool to its node
    assert bundle(cfg.cluster.gpus_per_engine, cfg.cluster.engine_resource) == \
        {"CPU": 1.0, "GPU": 1.0, "rollout_node": 0.001}
    assert bundle(cfg.cluster.gpus_per_learner, cfg.cluster.learner_resource) == \
        {"CPU": 1.0, "GPU": 1.0, "train_node": 0.001}
    cmd = server_command(cfg.rollout, "/ckpt", "10.0.0.1", 30000, 3, 1, cfg.cluster.gpus_per_engine)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--tp-size" in cmd


def test_sglang_without_gpus_is_refused():
    with pytest.raises(ValueError, match="rollout=sglang needs GPUs"):
        compose("rollout=sglang")


def test_two_node_quickstart_commands_are_real(tmp_path, chat_model_path):
    doc = os.path.join(REPO, "docs", "quickstart-two-node.md")
    cmds = doc_commands(doc)
    trainings = 0
    for cmd in cmds:
        for word in cmd:  # every script the doc runs is in the repo
            if word.startswith(("scripts/", "docker/")):
                assert os.path.exists(os.path.join(REPO, word)), word
        if "python" in cmd and any(w in ("train.py", "train_async.py") for w in cmd):
            i = max(cmd.index(w) for w in ("train.py", "train_async.py") if w in cmd)
            overrides = cmd[i + 1:]
            data = tmp_path / "gsm8k.jsonl"
            data.write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n")
            # paths that exist only on the cluster are swapped for local ones
            overrides = [f"model.path={chat_model_path}" if o.startswith("model.path=") else
                         f"task.path={data}" if o.startswith("task.path=") else o for o in overrides]
            cfg = compose(*overrides)
            if cfg.cluster.name == "two_node":  # the CPU rehearsal's command (tests/e2e/test_two_node.py)
                assert cfg.rollout.name == "hf"
                continue
            assert cfg.cluster.name == "two_node_8x8" and cfg.rollout.name == "sglang"
            trainings += 1
    assert trainings == 2
    # every command runs in the image the page builds, on the host's network and IPC
    (build,) = [c for c in cmds if c[:2] == ["docker", "build"]]
    (run,) = [c for c in cmds if c[:2] == ["docker", "run"]]
    assert build[build.index("-t") + 1] in run
    for flag in (["--gpus", "all"], ["--network", "host"], ["--ipc", "host"]):
        assert any(run[i:i + 2] == flag for i in range(len(run))), flag
    assert "--shm-size" in run


def test_head_serves_the_job_api_where_the_quickstart_submits():
    """``ray job submit --address http://<head IP>:PORT`` from another node needs the head's
    dashboard bound beyond localhost (Ray's default), on that port."""
    with open(os.path.join(REPO, "scripts", "start_head.sh")) as f:
        script = f.read().replace("\\\n", " ")
    start = shlex.split(next(line for line in script.splitlines() if line.startswith("ray start")))
    assert "--dashboard-host=0.0.0.0" in start
    port = next((w.split("=", 1)[1] for w in start if w.startswith("--dashboard-port=")), "8265")
    submits = [c for c in doc_commands(os.path.join(REPO, "docs", "quickstart-two-node.md"))
               if c[:3] == ["ray", "job", "submit"]]
    assert submits and all(c[c.index("--address") + 1] == f"http://10.0.0.1:{port}" for c in submits)
