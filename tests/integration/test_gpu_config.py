"""The GPU image's pins read the way the Dockerfile reads them (its own ``sed`` and
``python3 -c``), and the GSM8K preparation script the quickstart runs."""

from __future__ import annotations

import json
import os
import re


from tests.support.env import REPO


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


def test_gpu_checks_import_without_ray_wandb_mooncake_or_sglang():
    """scripts/gpu_check.sh runs where torch, transformers and the wheelhouse's Hydra and pytest
    are all there is: the GPU tests, their fixtures and the learner import without the rest."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('ray', 'wandb', 'mooncake', 'sglang'):\n"
            "            raise ImportError(f'{name} is not on the GPU check machine')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import rl.learner.learner, rl.rollout.engines.hf_engine, rl.learner.export_hf, pytest\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only',\n"
            "                      'tests/integration/test_gpu.py']))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout + run.stderr)[-2000:]
    assert "7 tests collected" in run.stdout, run.stdout[-2000:]
