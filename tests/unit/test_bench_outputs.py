"""A benchmark writes its JSON where the user said, and the tracked results under
benchmarks/results/ only when asked (``--out`` / ``--json`` naming them)."""

from __future__ import annotations

import importlib
import os

import pytest

from tests.support.env import REPO

RESULTS = os.path.join(REPO, "benchmarks", "results")
BENCHES = {"transfer_bench": "--out", "async_bench": "--out", "weight_sync_bench": "--out",
           "step_bench": "--json", "microbatch_bench": "--out", "decode_cost": "--out"}


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


def test_three_hosts_default_is_its_own_and_learners_lend():
    bench = importlib.import_module("benchmarks.transfer_bench")
    args = bench.parse_args(["--three-hosts", "--layouts", "producer-lends"])
    assert args.out not in (bench.parse_args(["--two-hosts"]).out, bench.parse_args([]).out)
    assert args.layouts == ["training"]


def test_netns_two_hosts_is_a_pair_and_three_share_a_bridge():
    from benchmarks.netns import Netns

    two, three = Netns(), Netns(prefix="rl3", subnet="10.231.8", hosts=("A", "B", "C"))
    assert (two.a, two.b, two.ip_a, two.ip_b, two.switch) == ("rlbA", "rlbB", "10.231.7.1",
                                                             "10.231.7.2", None)
    assert three.names == ["rl3A", "rl3B", "rl3C"] and three.switch == "rl3S"
    assert max(len(f"{ns}v") for ns in three.names) <= 15  # IFNAMSIZ


def _host(lo: float, tx: float, rx: float) -> dict[str, float]:
    return {"lo": lo, "tx": tx, "rx": rx}


def test_three_hosts_checks_a_batch_that_crosses_once_and_a_local_get():
    three = importlib.import_module("benchmarks.transfer_three_hosts")
    put = {"A": _host(0.0, 100.0, 1.0), "B": _host(0.0, 0.5, 50.0), "C": _host(0.0, 0.5, 50.0)}
    get = {h: _host(0.01, 0.1, 0.1) for h in "ABC"}
    ok = three.checks(put, get, mb=98.0, mooncake=True)
    assert ok["crosses_once"] and ok["put_crosses_once"] and ok["get_local"]
    looped = {**get, "B": _host(40.0, 0.1, 0.1)}  # a GET over loopback TCP
    assert not three.checks(put, looped, mb=98.0, mooncake=True)["get_local"]
    twice = {**get, "A": _host(0.0, 98.0, 1.0)}  # Ray's GET pulls the batch again
    assert not three.checks(put, twice, mb=98.0, mooncake=False)["crosses_once"]


def test_three_hosts_traffic_is_per_host_mb():
    three = importlib.import_module("benchmarks.transfer_three_hosts")
    before = {"A": {"rx_mb_lo": 0, "tx_mb_lo": 0, "rx_mb_rl3Av": 0, "tx_mb_rl3Av": 0}}
    after = {"A": {"rx_mb_lo": 2_000_000, "tx_mb_lo": 2_000_000, "rx_mb_rl3Av": 1_000_000,
                   "tx_mb_rl3Av": 5_000_000}}
    assert three.traffic(before, after) == {"A": _host(2.0, 5.0, 1.0)}


def test_microbatch_train_mode_compares_the_jobs_micro_batches_with_the_same_peak_budget():
    """``--train``: the job's micro-batch size against a budget of that many samples of the
    longest possible length (the same peak of token slots per pass); bad values fail first."""
    bench = importlib.import_module("benchmarks.microbatch_bench")
    job = ["task=repeat_count", "rollout.max_new_tokens=41", "rollout.max_prompt_tokens=8"]
    modes, overrides = bench.train_modes(bench.parse_args(["--train", "--", *job]))
    assert overrides == job
    assert modes == {"micro_batch_size=64": ["algo.micro_batch_size=64"],
                     "max_tokens_per_micro_batch=3136": ["algo.micro_batch_size=64",
                                                         "algo.max_tokens_per_micro_batch=3136"]}
    modes, _ = bench.train_modes(bench.parse_args(["--train", "--micro-batch-size", "16", "--", *job]))
    assert list(modes) == ["micro_batch_size=16", "max_tokens_per_micro_batch=784"]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        bench.train_modes(bench.parse_args(["--train", "--budget", "10", "--", *job]))
