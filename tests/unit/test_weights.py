"""Weight paths without a cluster: the p2p plan, a stale engine version named, and the
engines' command lines carrying ``model.dtype``. With a cluster:
tests/integration/test_weights.py and tests/e2e/test_weights.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from transfer.weights.broadcast import check_versions
from transfer.weights.p2p import plan_p2p


@dataclass
class _Engine:
    """Stands in for an engine's answers in plan and version checks (no process behind it)."""

    name: str
    num_ranks: int = 1
    version: str = "0"

    def get_weight_version(self) -> str:
        return self.version


@pytest.mark.parametrize("engines,senders,expected", [
    (4, 2, [[0, 2], [1, 3]]),
    (2, 2, [[0], [1]]),
    (1, 2, [[0], []]),
    (3, 1, [[0, 1, 2]]),
    (5, 2, [[0, 2, 4], [1, 3]]),
])
def test_p2p_plan_is_round_robin(engines, senders, expected):
    plan = plan_p2p(senders, [_Engine(f"e{i}") for i in range(engines)])
    assert plan == expected
    assert sorted(sum(plan, [])) == list(range(engines))  # every engine exactly once


def test_p2p_plan_balances_ranks_not_engines():
    # a tensor-parallel engine of 4 ranks receives 4 copies: it gets a sender of its own
    plan = plan_p2p(2, [_Engine("a", 4), _Engine("b"), _Engine("c"), _Engine("d")])
    assert plan == [[0], [1, 2, 3]]


def test_p2p_plan_needs_engines():
    with pytest.raises(ValueError, match="at least one engine"):
        plan_p2p(2, [])


def test_stale_engine_version_is_an_error_naming_it():
    engines = [_Engine("engine-0", version="4"), _Engine("engine-1", version="3")]
    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError) as e:
        check_versions(engines, 4, pool, timeout_s=5)
    assert "engine-1: reports version '3', expected 4" in str(e.value)
    assert "engine-0" not in str(e.value)


def test_engine_commands_carry_the_model_dtype():
    """model.dtype reaches both engines' command lines (SGLang 0.5.23 takes these spellings);
    SGLang's own --dtype in extra_args would undo it and is refused."""
    from rl.config import HFRolloutConfig, SGLangRolloutConfig
    from rl.rollout.engines.commands import server_command

    for dtype in ("float32", "bfloat16", "float16"):
        for rc in (HFRolloutConfig(), SGLangRolloutConfig()):
            cmd = server_command(rc, "/ckpt", "127.0.0.1", 30000, 0, 1, 1, dtype=dtype)
            assert cmd[cmd.index("--dtype") + 1] == dtype and cmd.count("--dtype") == 1
    for extra in (["--dtype", "half"], ["--dtype=half"]):
        with pytest.raises(ValueError, match="--dtype is set from model.dtype"):
            SGLangRolloutConfig(extra_args=extra)


def test_engine_kind_without_a_command_is_an_error_naming_the_known_ones():
    from rl.config import RolloutConfig
    from rl.rollout.engines.commands import server_command

    with pytest.raises(ValueError, match=r"rollout='vllm' \(RolloutConfig\).*known: "
                                         r"HFRolloutConfig \(hf\), SGLangRolloutConfig \(sglang\)"):
        server_command(RolloutConfig(name="vllm"), "/ckpt", "127.0.0.1", 30000, 0, 1, 1)
