"""Runs one engine server (the CPU engine or SGLang) as a child process and waits for it.

A plain class: ``rl.cluster`` makes it a Ray actor on the engine's bundle. The child dies
with its parent (PR_SET_PDEATHSIG), so a killed actor leaves no server behind.
"""

from __future__ import annotations

import os
import subprocess
import time

from rl.config import RolloutConfig
from rl.rollout.client import EngineClient
from rl.runtime import node_ip
from transfer.process import die_with_parent, log_tail, stop
from transfer.weights.group import free_port


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
        cmd = self.rollout.server_command(self.model_path, self.host, port, self.index, self.seed,
                                          self.gpus, **kwargs)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env},
                                         preexec_fn=die_with_parent)
        self.url = f"http://{self.host}:{port}"
        client = EngineClient(self.url, f"engine-{self.index}")
        deadline = time.monotonic() + self.rollout.engine_start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine-{self.index} exited with code {self.proc.returncode} "
                                   f"while starting; last lines of {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")
            remaining = deadline - time.monotonic()
            if client.health(timeout_s=max(1.0, min(self.rollout.health_check_timeout_s, remaining))):
                return self.url
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine-{self.index} did not answer /health within "
                           f"{self.rollout.engine_start_timeout_s:.0f}s "
                           f"(rollout.engine_start_timeout_s); last lines of {self.log_path}:\n"
                           f"{log_tail(self.log_path)}")

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        stop(self.proc, grace_s)
