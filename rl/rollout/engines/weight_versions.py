"""Which weight version produced which output tokens: SGLang 0.5.23's spans, for the CPU engine.

SGLang (``srt/utils/weight_versions.py``) records a ``WeightVersionEvent(old_version,
num_output_tokens)`` on every live request that holds output tokens when the served version
changes (``record_weight_version_events``, called by ``Scheduler.record_weight_version_change``
after each weight update); when the request finishes the scheduler turns its events into
``{version, start, end}`` spans over the output tokens (``compute_weight_version_spans``,
``scheduler_components/output_streamer.py``), and the tokenizer manager writes them to
``meta_info.weight_versions`` and the newest to ``meta_info.weight_version``
(``add_weight_versions_to_meta_info``). The two functions below are those functions, line
for line, on plain dicts: the project imports SGLang nowhere (it runs in its own process);
``tests/unit/test_weight_versions.py`` holds them equal to the pinned wheel's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VersionEvent:
    """SGLang's ``WeightVersionEvent``: the served version changed from ``old_version``
    while the request held ``num_output_tokens`` output tokens."""

    old_version: str
    num_output_tokens: int


def weight_version_spans(events: list[VersionEvent], current_version: str,
                         num_output_tokens: int) -> list[dict]:
    """``compute_weight_version_spans``: the tokens up to each event's count belong to its
    old version, the rest to ``current_version``; empty spans are dropped and neighbours of
    one version merged."""
    changes = [(e.old_version, e.num_output_tokens) for e in events]
    changes.append((current_version, num_output_tokens))
    spans: list[dict] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return spans


def add_weight_versions_to_meta_info(meta_info: dict[str, Any], spans: list[dict],
                                     num_output_tokens: int) -> None:
    """``add_weight_versions_to_meta_info``: the spans that hold a visible token (or the one
    that starts at 0), and ``weight_version`` = the newest of them."""
    visible = [s for s in spans if s["start"] < num_output_tokens or s["start"] == 0]
    meta_info["weight_versions"] = [
        {"version": s["version"], "start": s["start"], "end": min(s["end"], num_output_tokens)}
        for s in visible]
    meta_info["weight_version"] = visible[-1]["version"]
