"""docker/Dockerfile's ``COPY . .`` (build context: the repository root) carries the project
and none of the local environment, run outputs, history or caches: .dockerignore read with
Docker's own rules (moby's patternmatcher), no Docker needed."""

from __future__ import annotations

import os
import re
import subprocess

from tests.support.env import REPO

LEFT_OUT = [
    ".venv/bin/python", ".git/HEAD", ".lock-venv/bin/python", ".gpu-wheels/torch.whl",
    "build/lib/rl/types.py",
    "rl_datapath.egg-info/PKG-INFO", "outputs/2025-01-01/12-00-00/metrics.jsonl",
    "multirun/2025-01-01/0/metrics.jsonl", "wandb/offline-run-1/run.wandb",
    "__pycache__/train.cpython-312.pyc", "rl/learner/__pycache__/learner.cpython-312.pyc",
    "tests/stray.pyc", ".pytest_cache/v/cache/nodeids", ".hypothesis/examples/x", ".ruff_cache/x",
]


def _patterns() -> list[re.Pattern]:
    with open(os.path.join(REPO, ".dockerignore")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert not [p for p in lines if p.startswith("!")], "exceptions need ordered matching; not read here"
    return [_regex(os.path.normpath(p).lstrip("/")) for p in lines]


def _regex(pattern: str) -> re.Pattern:
    """moby patternmatcher: ``**`` spans any number of directories (none too), ``*`` and ``?``
    stay within one name."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in "*?":
            out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _left_out(path: str, patterns: list[re.Pattern]) -> bool:
    """Docker leaves a path out when a pattern matches it or one of its parent directories."""
    parts = path.split("/")
    return any(p.match("/".join(parts[:n])) for p in patterns for n in range(1, len(parts) + 1))


def _git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line.rstrip("/") for line in out.splitlines() if line]


def test_the_image_copy_leaves_out_environments_outputs_history_and_caches():
    patterns = _patterns()
    # and whatever git ignores in this checkout (a local .venv, outputs, caches) stays out too
    ignored_here = _git("ls-files", "--others", "--ignored", "--exclude-standard", "--directory")
    carried = [p for p in LEFT_OUT + ignored_here if not _left_out(p, patterns)]
    assert not carried, f"COPY . . would carry {carried}: add them to .dockerignore"


def test_the_image_copy_carries_every_file_of_the_project():
    patterns = _patterns()
    dropped = [p for p in _git("ls-files") if _left_out(p, patterns)]
    assert not dropped, f".dockerignore leaves out files of the project: {dropped}"
    with open(os.path.join(REPO, "docker", "Dockerfile")) as f:
        assert "\nCOPY . .\n" in f.read()  # the copy these rules apply to
