"""The command line that starts each engine kind's server, built from its ``rollout`` schema.

``server_command(cfg, ...)`` looks the schema's class up in ``COMMANDS`` (a subclass of a
registered schema gets its parent's command unless it registers its own). A new engine
kind: its schema in ``rl/config/rollout.py``, its function here, its entry in ``COMMANDS``.
"""

from __future__ import annotations

import sys
from typing import Callable

from rl.config.rollout import HFRolloutConfig, RolloutConfig, SGLangRolloutConfig


def hf_command(cfg: HFRolloutConfig, model_path: str, host: str, port: int, index: int,
               seed: int, gpus: int, dtype: str = "float32") -> list[str]:
    """The CPU engine (``rl.rollout.engines.hf_server``); ``gpus`` is unused (one process)."""
    return [sys.executable, "-m", "rl.rollout.engines.hf_server", "--model-path", model_path,
            "--host", host, "--port", str(port), "--seed", str(seed + 1000 * index),
            "--max-batch-size", str(cfg.max_batch_size),
            "--batch-wait-ms", str(cfg.batch_wait_ms), "--device", cfg.device,
            "--dtype", dtype]


def sglang_command(cfg: SGLangRolloutConfig, model_path: str, host: str, port: int, index: int,
                   seed: int, gpus: int, dtype: str = "float32") -> list[str]:
    """``sglang.launch_server`` with tensor-parallel size ``gpus``."""
    # SGLang is imported nowhere in this project: it only runs in the engine process.
    # --dtype: SGLang 0.5.23 accepts float32, bfloat16 and float16 as model.dtype spells
    # them; its default (auto) would run a float32 checkpoint in float16.
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", host, "--port", str(port), "--tp-size", str(gpus),
            "--mem-fraction-static", str(cfg.mem_fraction_static),
            "--random-seed", str(seed + 1000 * index), "--dtype", dtype, *cfg.extra_args]


COMMANDS: dict[type, Callable[..., list[str]]] = {HFRolloutConfig: hf_command,
                                                  SGLangRolloutConfig: sglang_command}
"""Command of each ``rollout`` schema class."""


def server_command(cfg: RolloutConfig, model_path: str, host: str, port: int, index: int,
                   seed: int, gpus: int, dtype: str = "float32") -> list[str]:
    """The command that starts engine ``index`` (an HTTP server on ``host:port``).
    ``dtype``: the engine's weight and compute dtype, ``model.dtype``: the learner pushes
    its weights cast to it, and computes in it."""
    command = next((COMMANDS[t] for t in type(cfg).__mro__ if t in COMMANDS), None)
    if command is None:
        known = ", ".join(f"{t.__name__} ({t.name})" for t in COMMANDS)
        raise ValueError(f"rollout={cfg.name!r} ({type(cfg).__name__}): no engine command is "
                         f"registered for it in rl.rollout.engines.commands.COMMANDS; known: {known}")
    return command(cfg, model_path, host, port, index, seed, gpus, dtype)
