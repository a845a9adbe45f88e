"""Runs one engine server (the CPU engine or SGLang) as a child process and waits for it.

A plain class: ``rl.rollout.fleet`` makes it a Ray actor on the engine's bundle. The child dies
with its parent (PR_SET_PDEATHSIG), so a killed actor leaves no server behind.
"""

from __future__ import annotations

import os
import subprocess
import time

from rl.config import RolloutConfig
from rl.rollout.client import EngineClient
from rl.rollout.engines.commands import server_command
from rl.runtime import node_ip
from transfer.net import free_port
from transfer.process import start_child, stop


class EngineProcess:
    def __init__(self, index: int, rollout: RolloutConfig, model_path: str, seed: int,
                 log_dir: str, host: str | None, env: dict[str, str] | None = None,
                 gpus: int = 0, dtype: str | None = None) -> None:
        """``dtype``: the engine's dtype (``model.dtype``); unset = the config's default,
        float32."""
        self.index = index
        self.gpus = gpus
        self.dtype = dtype
        self.rollout = rollout
        self.model_path = model_path
        self.seed = seed
        self.host = host
        self.env = env or {}
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"engine_{index}.log")
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> str:
        """Start the server and wait until it answers /health; return its URL."""
        if not self.host:
            self.host = node_ip()  # resolved here, on the engine's own node
        port = free_port(self.host)
        kwargs = {"dtype": self.dtype} if self.dtype is not None else {}
        cmd = server_command(self.rollout, self.model_path, self.host, port, self.index, self.seed,
                             self.gpus, **kwargs)
        self.url = f"http://{self.host}:{port}"
        client = EngineClient(self.url, f"engine-{self.index}")
        timeout_s = self.rollout.engine_start_timeout_s
        deadline = time.monotonic() + timeout_s

        def healthy() -> bool:
            remaining = deadline - time.monotonic()
            return client.health(timeout_s=max(1.0, min(self.rollout.health_check_timeout_s,
                                                         remaining)))

        self.proc = start_child(cmd, name=f"engine-{self.index}", log_path=self.log_path,
                                ready=healthy, timeout_s=timeout_s, waits_for="/health",
                                timeout_hint="rollout.engine_start_timeout_s", env=self.env,
                                poll_s=0.2)
        return self.url

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        stop(self.proc, grace_s)
