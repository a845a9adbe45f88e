"""The commands a Markdown page shows, for the tests that hold a page to what it runs."""

from __future__ import annotations

import re
import shlex


def doc_commands(path: str) -> list[list[str]]:
    """Each command of the fenced blocks of a Markdown page, split as a shell would (a
    backslash continues a line, ``#`` starts a comment)."""
    text = open(path).read()
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    cmds = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            if line:
                cmds.append(shlex.split(line))
    return cmds
