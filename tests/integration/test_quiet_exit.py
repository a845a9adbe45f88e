"""A process of a run loads the model without importing triton, and exits without the
nanobind "leaked" dump triton's bindings print (``rl.log.block_triton``)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
import sys
from rl.log import block_triton
if sys.argv[2] == "blocked":
    block_triton()
from rl.model import load_model
model = load_model(sys.argv[1])
print("triton imported:", sys.modules.get("triton") is not None)
gc.freeze()  # as the run's processes exit: nothing collected one by one
"""


def test_a_model_loads_without_triton_and_exits_quietly(tiny_path):
    runs = {how: subprocess.run([sys.executable, "-c", SCRIPT, tiny_path, how], capture_output=True,
                                text=True, timeout=120) for how in ("blocked", "default")}
    blocked, default = runs["blocked"], runs["default"]
    assert blocked.returncode == 0, blocked.stderr[-2000:]
    assert "triton imported: False" in blocked.stdout and "leaked" not in blocked.stdout + blocked.stderr
    # without the block, this environment (triton installed for the SGLang contract tests)
    # imports triton while loading the model and prints the dump at exit
    assert "triton imported: True" in default.stdout and "leaked" in default.stderr
