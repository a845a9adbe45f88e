"""The commands a Markdown page shows, for the tests that hold a page to what it runs.

Every fenced block of README.md and docs/*.md names what it holds: ``bash`` (commands, one a
line, to be run or composed), ``console`` (``$ command`` lines, each followed by what it
prints; ``...`` stands for lines or text left out), ``text`` (output, diagrams, listings) or
``python`` (code)."""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass

from tests.support.env import REPO

LANGS = ("bash", "console", "text", "python")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_COMMAND_START = ("python ", ".venv/bin/python ", "make ", "pytest ", "bash ")


def doc_pages() -> list[str]:
    """README.md and every page under docs/."""
    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


@dataclass
class Block:
    lang: str
    text: str
    line: int
    """Line of the opening fence (1-based)."""


def fenced_blocks(path: str) -> list[Block]:
    text = open(path).read()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(text)]


def _split(block: str) -> list[list[str]]:
    """Each command of a block, split as a shell would (a backslash continues a line, ``#``
    starts a comment)."""
    cmds = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#")[0].strip()
        if line:
            cmds.append(shlex.split(line))
    return cmds


def doc_commands(path: str) -> list[list[str]]:
    """Each command of the ``bash`` blocks of a Markdown page."""
    return [c for b in fenced_blocks(path) if b.lang in ("bash", "") for c in _split(b.text)]


def inline_commands(path: str) -> list[list[str]]:
    """Commands quoted inline (`` `python ...` ``, `` `make ...` ``...) outside the fenced
    blocks, complete ones only: no ``<placeholder>`` and no ``...``."""
    text = _FENCE.sub("", open(path).read())
    spans = [m.group(1) for m in _INLINE.finditer(text)]
    return [shlex.split(s) for s in spans
            if s.startswith(_COMMAND_START) and "<" not in s and "..." not in s]


def console_sessions(path: str) -> list[tuple[list[str], list[str]]]:
    """``(command, lines it prints)`` for each ``$ command`` of the page's console blocks."""
    sessions: list[tuple[list[str], list[str]]] = []
    for b in fenced_blocks(path):
        if b.lang != "console":
            continue
        for line in b.text.splitlines():
            if line.startswith("$ "):
                sessions.append((shlex.split(line[2:]), []))
            elif sessions:
                sessions[-1][1].append(line)
    return sessions


def matches(expected: list[str], output: str) -> bool:
    """Whether ``output`` holds the expected lines in order; ``...`` (a line, or inside one)
    stands for anything left out."""
    pattern = ".*?".join(re.escape(part.strip()) for line in expected
                         for part in line.split("...") if part.strip())
    return re.search(pattern, output, re.S) is not None
