"""One logging set-up for every process of a run: ``HH:MM:SS LEVEL name: message`` on stdout.

Modules log through ``logging.getLogger(__name__)``; nothing is printed except the one
console line per training step (``rl.driver.metrics``). The driver calls ``setup_logging(cfg.log_level)``
at start-up; Ray worker processes (rollout manager, learner ranks, engine actors) start with
no handler, so ``Cluster`` passes the level in ``RL_LOG_LEVEL`` and names
``setup_worker_logging`` as Ray's ``worker_process_setup_hook`` (``WORKER_SETUP_HOOK``),
which runs in each worker before any actor is built. Ray forwards a worker's stdout to the
driver's, prefixed with the actor's name and pid.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""Levels ``log_level`` accepts."""
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"
LEVEL_ENV = "RL_LOG_LEVEL"
"""Carries the level from the driver to Ray worker processes."""
WORKER_SETUP_HOOK = f"{__name__}.setup_worker_logging"
"""Ray's ``runtime_env["worker_process_setup_hook"]`` for a run's workers."""


def setup_logging(level: str = "INFO") -> None:
    """Log ``level`` and above from every module to stdout in ``FORMAT``. Replaces the root's
    console handlers (Hydra installs one with its own format, and an earlier call ours); a
    file handler (Hydra's ``<job>.log`` in the run directory) stays, in the same format."""
    root = logging.getLogger()
    formatter = logging.Formatter(FORMAT, DATEFMT)
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler):
            h.setFormatter(formatter)
        else:
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level)


def setup_worker_logging() -> None:
    """Ray's ``worker_process_setup_hook``: ``setup_logging`` at the driver's level, and no
    triton (``block_triton``)."""
    block_triton()
    setup_logging(os.environ.get(LEVEL_ENV, "INFO"))


def block_triton() -> None:
    """Keep triton out of this process: ``import triton`` raises ImportError from now on.
    torch imports triton only to probe for it (``torch._dynamo``, which transformers' model
    code pulls in), and triton's nanobind bindings then print dozens of "leaked instance"
    lines when the process exits. No process of a run executes a triton kernel (no
    ``torch.compile``; an SGLang server is a process of its own, which this does not reach),
    so the driver, the CPU engine and every Ray worker call this at start-up."""
    sys.modules.setdefault("triton", None)


def first_line(e: BaseException) -> str:
    """The first line of an error's message (a Ray task error's: of the error it carries)."""
    cause = getattr(e, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else e).strip()
    return text.splitlines()[0] if text else type(e).__name__
