"""Every command that README.md and docs/*.md show runs as shown, or, where it needs GPUs,
Docker, two nodes or a whole training run, composes: ``python train.py ...`` (and
``train_async.py``, ``make train ARGS=...``, ``ray job submit ... -- python train.py ...``)
compose their config in-process; small tools run for real on tiny inputs; benchmarks parse
their arguments; scripts exist and parse as bash. A command no rule knows fails the test, so
a new one gets a rule (or a fix) before it reaches a reader. Also: every fenced block names
what it holds, quoted console sessions print what they quote, and no page cites a commit."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.support.docs import (LANGS, console_sessions, doc_commands, doc_pages, fenced_blocks,
                                inline_commands, matches)
from tests.support.env import REPO, compose

TRAIN_SCRIPTS = ("train.py", "train_async.py")
SUMMARIES = {"scripts/calculator_summary.py", "scripts/curve_summary.py"}
"""Scripts that print rows of a table from the runs kept in docs/runs: the page that shows the
command holds them (a command shown on two pages is run once, held to the first page read)."""
MAKE_TARGETS = set(re.findall(r"^([\w-]+):", open(os.path.join(REPO, "Makefile")).read(), re.M))


def _all_commands() -> list[tuple[str, list[str]]]:
    """(page, command), each distinct command once."""
    seen, out = set(), []
    for page in doc_pages():
        for cmd in doc_commands(page) + inline_commands(page):
            key = tuple(cmd)
            if key not in seen:
                seen.add(key)
                out.append((os.path.relpath(page, REPO), cmd))
    return out


COMMANDS = _all_commands()


def _strip_prefixes(cmd: list[str]) -> list[str]:
    """The command a wrapper runs: ``VAR=value cmd``, ``flock LOCK cmd``,
    ``ray job submit ... -- cmd``."""
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):
        cmd = cmd[1:]
    if cmd[:1] == ["flock"]:
        cmd = cmd[2:]
    if cmd[:3] == ["ray", "job", "submit"]:
        cmd = cmd[cmd.index("--") + 1:]
    return cmd


def _local_overrides(overrides: list[str], request, tmp_path) -> list[str]:
    """Paths that exist only on a cluster or after a run, swapped for local ones."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model.path" and not os.path.exists(value):
            o = f"model.path={request.getfixturevalue('chat_model_path')}"
        elif key == "task.path":
            path = value if os.path.isabs(value) else os.path.join(REPO, value)
            if not os.path.exists(path):
                path = str(tmp_path / "prompts.jsonl")
                with open(path, "w") as f:
                    f.write(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
            o = f"task.path={path}"
        elif key == "checkpoint.resume" and "<" in value:  # outputs/<date>/<time>/...: a past run's
            ckpt = tmp_path / "run" / "checkpoints" / "step_000150"
            ckpt.mkdir(parents=True)
            (ckpt / "trainer_state.json").write_text(json.dumps({"step": 150}))
            o = f"{key}={ckpt}"
        out.append(o)
    return out


def _run(cmd: list[str], cwd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "MPLBACKEND": "Agg"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _python(args: list[str], tmp_path, request, page: str) -> None:
    script = args[0]
    if script in TRAIN_SCRIPTS:
        if "--help" in args:  # Hydra's help: run it, it is quick
            proc = _run([sys.executable, os.path.join(REPO, script), *args[1:]], str(tmp_path))
            assert proc.returncode == 0 and "== Config ==" in proc.stdout, proc.stderr
            return
        compose(*_local_overrides(args[1:], request, tmp_path))
    elif script == "-m":
        module = args[1]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        if module.startswith(("rl.", "transfer.")):  # ours: each flag shown is one it takes
            proc = _run([sys.executable, "-m", module, "--help"], str(tmp_path))
            assert proc.returncode == 0, proc.stderr
            for flag in (a for a in args[2:] if a.startswith("--")):
                assert flag in proc.stdout, f"{module} has no {flag}"
    elif script.startswith("benchmarks/") and "plot" not in script:  # long runs: arguments only
        module = importlib.import_module(script[:-3].replace("/", "."))
        module.parse_args(args[1:])
    elif script == "scripts/prepare_gsm8k.py":  # GSM8K is yours to download: a one-line stand-in
        src, dst = tmp_path / "gsm8k.jsonl", tmp_path / "out.jsonl"
        src.write_text(json.dumps({"question": "1+1?", "answer": "so 2 #### 2"}) + "\n")
        proc = _run([sys.executable, os.path.join(REPO, script), str(src), str(dst)], str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(dst.read_text())["label"] == "2"
    elif script in SUMMARIES:  # run for real on the runs kept in docs/runs
        paths = [a for a in args[1:] if not a.startswith("--")]
        flags = [a for a in args[1:] if a in ("--mean", "--by-dump")]
        proc = _run([sys.executable, os.path.join(REPO, script), *flags,
                     *(os.path.join(REPO, a) for a in paths)], str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        printed = proc.stdout.splitlines()
        if "--by-dump" in args:  # a row per dumped step: at least one per run
            assert len(printed) >= len(paths), proc.stdout
        else:
            assert len(printed) == len(paths) + ("--mean" in args), proc.stdout  # --mean: one more
        # the rows' figures (all but the name; "-" where the run kept no data for a column) are
        # rows of the page's table, in the command's order, one after the other
        cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")][1:]  # noqa: E731
        with open(os.path.join(REPO, page)) as f:
            rows = [cells(line) for line in f if line.startswith("| ")]
        got = [cells(line) for line in printed]
        fits = lambda row, want: len(row) == len(want) and all(g in ("-", w) for g, w in zip(want, row))  # noqa: E731
        starts = [i for i in range(len(rows) - len(got) + 1) if all(map(fits, rows[i:i + len(got)], got))]
        assert starts, f"{proc.stdout} are not rows of {page}, in order, one after the other"
    elif script.startswith(("scripts/plot", "benchmarks/plot")):  # run for real; figures to tmp
        argv = [str(tmp_path / os.path.basename(a)) if a.endswith(".png") else os.path.join(REPO, a)
                for a in args[1:]]
        proc = _run([sys.executable, os.path.join(REPO, script), *argv], str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert all(os.path.getsize(a) > 0 for a in argv if a.endswith(".png"))
    else:
        pytest.fail(f"no rule checks `python {shlex.join(args)}`: add one to {__file__}")


def _pytest(args: list[str]) -> None:
    path = next(a for a in args if a.endswith(".py"))
    source = open(os.path.join(REPO, path)).read()
    if "-k" in args:
        k = args[args.index("-k") + 1]
        assert re.search(rf"def test_\w*{re.escape(k)}", source), f"no test in {path} matches -k {k}"


@pytest.mark.parametrize("page,cmd", COMMANDS, ids=[f"{p}:{shlex.join(c)[:60]}" for p, c in COMMANDS])
def test_doc_command(page, cmd, tmp_path, request):
    cmd = _strip_prefixes(cmd)
    head = cmd[0]
    if head in ("python", ".venv/bin/python"):
        _python(cmd[1:], tmp_path, request, page)
    elif head == "make":
        target = cmd[1]
        assert target in MAKE_TARGETS, f"the Makefile has no target {target}"
        for arg in cmd[2:]:
            if arg.startswith("ARGS=") and target == "train":
                compose(*_local_overrides(shlex.split(arg[5:]), request, tmp_path))
    elif head == "bash":
        script = os.path.join(REPO, cmd[1])
        assert os.path.isfile(script), cmd[1]
        assert subprocess.run(["bash", "-n", script]).returncode == 0, f"{cmd[1]} does not parse"
    elif head == "pytest":
        _pytest(cmd)
    elif head == "docker":  # GPU image: its files exist, and what runs is what was built
        if cmd[1] == "build":
            assert os.path.isfile(os.path.join(REPO, cmd[cmd.index("-f") + 1]))
        else:
            built = [c for c in doc_commands(os.path.join(REPO, page)) if c[:2] == ["docker", "build"]]
            tags = {c[c.index("-t") + 1] for c in built}
            assert tags & set(cmd), f"docker run uses none of the built images {tags}"
    elif head == "git" and cmd[1] == "clone":
        pass  # fetches this repository: the one command that cannot run from inside it
    else:
        pytest.fail(f"no rule checks `{shlex.join(cmd)}` ({page}): add one to {__file__}")


def test_every_fenced_block_says_what_it_holds():
    """An untagged block would be neither run nor skipped on purpose."""
    bad = [f"{os.path.relpath(p, REPO)}:{b.line} ```{b.lang}" for p in doc_pages()
           for b in fenced_blocks(p) if b.lang not in LANGS]
    assert not bad, f"tag each fenced block with one of {LANGS}: {bad}"


SESSIONS = [(os.path.relpath(p, REPO), cmd, out) for p in doc_pages() for cmd, out in console_sessions(p)]


@pytest.mark.parametrize("page,cmd,expected", SESSIONS, ids=[shlex.join(c) for _, c, _ in SESSIONS])
def test_console_session_prints_what_the_page_quotes(page, cmd, expected, tmp_path):
    """Run from an empty directory: the quoted output is what it prints, and (a config error)
    it leaves nothing behind."""
    assert cmd[0] == "python" and cmd[1] in TRAIN_SCRIPTS, cmd
    proc = _run([sys.executable, os.path.join(REPO, cmd[1]), *cmd[2:]], str(tmp_path))
    assert matches(expected, proc.stdout + proc.stderr), (page, expected, proc.stderr)
    assert os.listdir(tmp_path) == []


def test_no_page_cites_a_commit():
    """Commit hashes date a page; figures belong in docs/benchmarks.md with their date."""
    found = [(os.path.relpath(p, REPO), w) for p in doc_pages()
             for w in re.findall(r"\b[0-9a-f]{7,40}\b", open(p).read())
             if re.search(r"[a-f]", w) and re.search(r"[0-9]", w)]
    assert not found, found
