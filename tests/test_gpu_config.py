"""The GPU configurations compose, place 8 + 8 GPUs on two nodes, and the two-node
quickstart's commands are real: every script exists, every override composes."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from rl.cluster import _bundle, describe_placement
from tests.conftest import REPO, compose


@pytest.mark.parametrize("transfer", ["mooncake_rdma", "mooncake_tcp", "ray"])
@pytest.mark.parametrize("weights", ["p2p", "broadcast"])
def test_two_node_gpu_combinations_compose(transfer, weights):
    cfg = compose("cluster=two_node_8x8", "rollout=sglang", "model.dtype=bfloat16", f"transfer={transfer}",
                  f"weights={weights}")
    plan = describe_placement(cfg)
    assert "8 sglang engines x 1 GPU on nodes with resource 'rollout_node' (8 GPUs)" in plan
    assert "8 learner ranks x 1 GPU on nodes with resource 'train_node' (8 GPUs)" in plan
    # the bundles pin each pool to its node
    assert _bundle(cfg.cluster.gpus_per_engine, cfg.cluster.engine_resource) == \
        {"CPU": 1.0, "GPU": 1.0, "rollout_node": 0.001}
    assert _bundle(cfg.cluster.gpus_per_learner, cfg.cluster.learner_resource) == \
        {"CPU": 1.0, "GPU": 1.0, "train_node": 0.001}
    cmd = cfg.rollout.server_command("/ckpt", "10.0.0.1", 30000, 3, 1, cfg.cluster.gpus_per_engine)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--tp-size" in cmd


def test_sglang_without_gpus_is_refused():
    with pytest.raises(ValueError, match="rollout=sglang needs GPUs"):
        compose("rollout=sglang")


def _doc_commands(path: str) -> list[list[str]]:
    text = open(path).read()
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    cmds = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            if line:
                cmds.append(shlex.split(line))
    return cmds


def test_two_node_quickstart_commands_are_real(tmp_path, chat_model_path):
    doc = os.path.join(REPO, "docs", "quickstart-two-node.md")
    cmds = _doc_commands(doc)
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
            if cfg.cluster.name == "two_node":  # the CPU rehearsal's command (tests/test_two_node.py)
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
    submits = [c for c in _doc_commands(os.path.join(REPO, "docs", "quickstart-two-node.md"))
               if c[:3] == ["ray", "job", "submit"]]
    assert submits and all(c[c.index("--address") + 1] == f"http://10.0.0.1:{port}" for c in submits)


def test_image_installs_the_one_pinned_sglang():
    """The Dockerfile reads the SGLang pin from rl/rollout/sglang_version.py, with its own
    ``sed``, and names no version or extra of its own."""
    import subprocess

    from rl.rollout.sglang_version import SGLANG_VERSION

    with open(os.path.join(REPO, "docker", "Dockerfile")) as f:
        dockerfile = f.read()
    m = re.search(r"v=\$\(sed -n '([^']*)' (rl/rollout/sglang_version\.py)\)", dockerfile)
    assert m, "the Dockerfile no longer reads the pin with sed"
    got = subprocess.run(["sed", "-n", m.group(1), m.group(2)], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert got == SGLANG_VERSION
    commands = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    assert 'pip install "sglang==$v"' in commands
    assert "sglang[" not in commands and SGLANG_VERSION not in commands


def test_prepare_gsm8k(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}) + "\n")
    dst = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_gsm8k.py"), str(src), str(dst)],
                   check=True, capture_output=True)
    row = json.loads(dst.read_text())
    assert row["label"] == "5" and row["prompt"].startswith("What is 2+3?")
    from rl.tasks.rewards import math_answer

    assert math_answer("... so #### 5", row["label"]) == 1.0


def test_image_installs_the_one_pinned_mooncake():
    """Mooncake's CUDA 13 wheel is pinned once, in pyproject.toml's ``gpu`` extra, at the
    release of the ``cpu`` extra's non-CUDA wheel (the one the CPU tests run, in
    constraints-cpu.txt); the Dockerfile reads it from there and names no version of its own."""
    import subprocess
    import sys
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    pins = {extra: dict(spec.split("==") for spec in extras[extra]) for extra in ("cpu", "gpu")}
    assert set(pins["gpu"]) == {"mooncake-transfer-engine-cuda13"}
    assert set(pins["gpu"].values()) == set(pins["cpu"].values()) == \
        {pins["cpu"]["mooncake-transfer-engine-non-cuda"]}
    version = pins["gpu"]["mooncake-transfer-engine-cuda13"]
    with open(os.path.join(REPO, "constraints-cpu.txt")) as f:
        assert f"mooncake-transfer-engine-non-cuda=={version}\n" in f.read()

    with open(os.path.join(REPO, "docker", "Dockerfile")) as f:
        dockerfile = f.read()
    commands = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    m = re.search(r"python3 -c '([^']*)' > /tmp/gpu\.txt && \\\n\s*pip install -r /tmp/gpu\.txt", commands)
    assert m, "the Dockerfile no longer installs the gpu extra's pins read from pyproject.toml"
    got = subprocess.run([sys.executable, "-c", m.group(1)], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    assert got == extras["gpu"]
    assert 'pip install -e ".[gpu,test]"' in commands
    assert version not in commands and "[cpu" not in commands and ",cpu" not in commands
    assert commands.count("mooncake") == 0  # every Mooncake wheel comes from the pin
