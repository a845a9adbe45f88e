"""A benchmark writes its JSON where the user said, and the tracked results under
benchmarks/results/ only when asked (``--out`` / ``--json`` naming them)."""

from __future__ import annotations

import importlib
import os

import pytest

from tests.support.env import REPO

RESULTS = os.path.join(REPO, "benchmarks", "results")
BENCHES = {"transfer_bench": "--out", "async_bench": "--out", "weight_sync_bench": "--out",
           "step_bench": "--json"}


@pytest.mark.parametrize("name,flag", BENCHES.items())
def test_benchmark_default_leaves_tracked_results_alone(name, flag):
    bench = importlib.import_module(f"benchmarks.{name}")
    dest = getattr(bench.parse_args([]), flag.lstrip("-"))
    assert dest is None or not os.path.abspath(dest).startswith(RESULTS + os.sep), dest
    asked = os.path.join(RESULTS, f"{name}.json")
    assert getattr(bench.parse_args([flag, asked]), flag.lstrip("-")) == asked


def test_two_hosts_default_is_apart_from_same_host():
    bench = importlib.import_module("benchmarks.transfer_bench")
    assert bench.parse_args(["--two-hosts"]).out != bench.parse_args([]).out
