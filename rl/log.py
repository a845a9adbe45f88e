"""One logging set-up for every process of a run: ``HH:MM:SS LEVEL name: message`` on stdout.

Modules log through ``logging.getLogger(__name__)``; nothing is printed except the one
console line per training step (``rl.metrics``). The driver calls ``setup_logging(cfg.log_level)``
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
    """Ray's ``worker_process_setup_hook``: ``setup_logging`` at the driver's level."""
    setup_logging(os.environ.get(LEVEL_ENV, "INFO"))

