"""The environment every test process runs in, set on import (each tier's conftest imports
it, and so does every support module that names ``REPO``): W&B offline, quiet tokenizers and
Mooncake, Ray's token auth off, the repository importable, Ctrl-C delivered. Kept free of
torch: a subprocess that checks what composing a config imports starts from here."""

from __future__ import annotations

import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONF = os.path.join(REPO, "conf")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
# Ray 2.60 reads its auth mode once per process: every Ray of the session (the test process's
# own, the shared heads, the runs') leaves token auth off, as the two-node rehearsal does.
# Runs that stand for `make train` (procs.own_ray_env) get Ray's default back.
AUTH_OFF_HERE = "RAY_AUTH_MODE" not in os.environ
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
if REPO not in sys.path:
    sys.path.insert(0, REPO)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # pytest started as a background job
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the runs it starts get Ctrl-C again


def compose(*overrides: str):
    """The typed config that ``python train.py <overrides>`` would run with."""
    from rl.config import compose as compose_config

    return compose_config(*overrides)
