"""``algo.turn_credit``: an advantage per model turn. The turns of a response, the advantages
by hand (one turn: GRPO's exactly), the calculator's turn rewards, the batch's per-token
column through the store columns and a partition, the loss with a per-token advantage, and the
config's check. Through ``train.py`` and the stores: tests/integration/test_train.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.algo import policy_loss_bt
from rl.rollout.batch import build_batch, grpo_advantages, model_turns, turn_advantages, zero_std_groups
from rl.rollout.functions import Sample
from rl.tasks import Prompt
from rl.tasks.builtin import CalculatorTask
from rl.types import RolloutBatch
from transfer.data import codec
from tests.support.env import compose


def test_model_turns_are_the_runs_of_trained_tokens():
    assert model_turns([1, 1, 0, 0, 1]) == [(0, 2), (4, 5)]
    assert model_turns([1, 1, 1]) == [(0, 3)]
    assert model_turns([0, 1, 0, 1, 1, 0]) == [(1, 2), (3, 5)]
    assert model_turns([]) == [] and model_turns([0, 0]) == []


def test_turn_advantages_by_hand_and_one_turn_is_grpo():
    rewards = [0.0, 0.5, 1.0, 0.5]
    one = turn_advantages([[r] for r in rewards])
    assert np.concatenate(one) == pytest.approx(grpo_advantages(np.asarray(rewards, np.float32), 4), abs=1e-6)
    # turn 0 over all four samples, turn 1 over the three that have one; each turn is judged
    # by its own reward only
    got = turn_advantages([[0.2, 0.0], [0.5, 0.5], [0.5], [0.2, 0.5]], std_norm=False)
    call = np.array([0.2, 0.5, 0.5, 0.2]) - 0.35
    answer = np.array([0.0, 0.5, 0.5]) - 1 / 3
    assert [list(a) for a in got] == [pytest.approx([call[0], answer[0]]),
                                      pytest.approx([call[1], answer[1]]),
                                      pytest.approx([call[2]]), pytest.approx([call[3], answer[2]])]
    scaled = turn_advantages([[0.0, 1.0], [1.0, 0.0]])  # each turn over its std
    assert [list(a) for a in scaled] == [pytest.approx([-1.0, 1.0], abs=1e-5),
                                         pytest.approx([1.0, -1.0], abs=1e-5)]
    assert turn_advantages([[], [1.0]]) == [pytest.approx([]), pytest.approx([0.0])]  # no turn; alone: 0
    flat = turn_advantages([[0.35, 1.0]] * 6 + [[0.35, 0.5]])  # six alike and one: rounding
    assert all(a[0] == 0.0 for a in flat)  # the flat turn exactly 0, not 1e-11


def test_calculator_turn_rewards_credit_the_call_and_the_copy_apart():
    t = CalculatorTask()
    assert t.turn_rewards("2+3=5 5", "2+3", True, 2) == pytest.approx([0.5, 1.0])
    assert t.turn_rewards("2+3=5 =", "2+3", True, 2) == pytest.approx([0.5, 0.5])  # the sum, ended, no copy
    assert t.turn_rewards("2-3=-1 -1", "2+3", True, 2) == pytest.approx([0.5, 1.0])  # the operator unchecked
    assert t.reward("2-3=-1 -1", "2+3", True) == pytest.approx(0.5)  # where the reward gives it half
    assert t.turn_rewards("1+4=5 5", "2+3", True, 2) == pytest.approx([0.2, 1.0])  # the sum by chance
    assert t.turn_rewards("2+4=6 6", "2+3", True, 2) == pytest.approx([0.35, 1.0])  # a copy of a wrong sum
    assert t.reward("2+4=6 6", "2+3", True) == pytest.approx(0.35)  # the reward itself: unchanged
    assert t.turn_rewards("2+4=6 66", "2+3", True, 2) == pytest.approx([0.35, 0.75])  # by character
    assert t.turn_rewards("2+=error 3", "2+3", True, 2) == pytest.approx([0.2 * 2 / 3, 0.5])
    assert t.turn_rewards("5", "2+3", True, 1) == [0.0]  # no call: the reward, 0
    assert t.turn_rewards("2+3=5 5", "2+3", False, 2) == pytest.approx([0.5, 0.0])  # the answer did not end
    assert t.turn_rewards("2+3=5 ", "2+3", False, 1) == pytest.approx([0.5])  # no room left to answer
    with pytest.raises(ValueError, match="a calculator sample of 3 model turn"):
        t.turn_rewards("2+3=5 5", "2+3", True, 3)


def _sample(mask: list[int], text: str, reward: float | None = None) -> Sample:
    n = len(mask)
    return Sample([1, 2], list(range(3, 3 + n)), mask, [-0.5 if m else 0.0 for m in mask], True,
                  [{}, {}], text, reward=reward)


def test_build_batch_gives_each_turn_its_advantage_and_the_columns_carry_it():
    t = CalculatorTask()
    prompt = Prompt(text="2+3:", label="2+3", index=0)
    call_answer = [1, 1, 1, 1, 0, 0, 1, 1]  # "2+3=" "5 " "5<eos>" as tokens
    group = [_sample(call_answer, "2+3=5 5"), _sample(call_answer, "2+3=5 ="),
             _sample(call_answer, "2+4=6 6"), _sample([1, 1], "5", reward=0.25)]  # its own reward
    batch = build_batch([prompt], [group], t.reward, turn_rewards=t.turn_rewards, group_size=4,
                        std_norm=False, first_sample_id=0)
    call = np.array([0.5, 0.5, 0.35, 0.25]) - np.mean([0.5, 0.5, 0.35, 0.25])  # the last: its one turn
    answer = np.array([1.0, 0.5, 1.0]) - np.mean([1.0, 0.5, 1.0])
    for i in range(3):
        want = [call[i]] * 4 + [0.0, 0.0] + [answer[i]] * 2  # 0 on the tool's tokens
        assert batch.token_advantages[i].tolist() == pytest.approx(want, abs=1e-6)
    assert batch.token_advantages[3].tolist() == pytest.approx([call[3]] * 2, abs=1e-6)
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.5, 0.35, 0.25])  # the task's reward, as logged
    # through the store's columns and a partition, the column stays; without it, none is stored
    back = RolloutBatch.from_columns(batch.to_columns()).select([2, 0])
    assert back.token_advantages[0].tolist() == pytest.approx(batch.token_advantages[2].tolist())
    assert back.token_advantages[1].tolist() == pytest.approx(batch.token_advantages[0].tolist())
    plain = build_batch([prompt], [group], t.reward, group_size=4, std_norm=False, first_sample_id=0)
    assert plain.token_advantages is None and "token_advantages" not in plain.to_columns()
    assert RolloutBatch.from_columns(plain.to_columns()).select([1]).token_advantages is None
    # the store's estimate makes room for it only when asked, as much as the packed codec takes
    for n, r in ((1, 1), (8, 16), (64, 41)):
        full = RolloutBatch(**{**plain.select([0] * n).__dict__, "response_len": np.full(n, r, np.int32),
                               "tokens": [np.ones(2 + r, np.int32)] * n,
                               "loss_mask": [np.ones(r, np.int8)] * n,
                               "rollout_logprobs": [np.zeros(r, np.float32)] * n})
        with_adv = RolloutBatch(**{**full.__dict__, "token_advantages": [np.zeros(r, np.float32)] * n})
        grown = codec.plan(with_adv.to_columns()).nbytes - codec.plan(full.to_columns()).nbytes
        assert grown <= (RolloutBatch.estimate_nbytes(n, 2, r, label_bytes=3, token_advantages=True)
                         - RolloutBatch.estimate_nbytes(n, 2, r, label_bytes=3)), (n, r)
    # a group whose rewards are equal but whose answers differ is not flat under turn credit
    pair = [_sample(call_answer, "2+4=6 6"), _sample(call_answer, "2+4=6 =")]  # both 0.35
    for turns, flat in ((t.turn_rewards, 0), (None, 1)):
        b = build_batch([prompt], [pair], t.reward, turn_rewards=turns, group_size=2, std_norm=True,
                        first_sample_id=0)
        assert zero_std_groups(b, 2, drop=True) == flat
        assert (b.loss_mask.values.sum() == 0) == bool(flat)
    with pytest.raises(ValueError, match=r"gave 1 rewards for a sample of 2 model turn\(s\) of prompt 0"):
        build_batch([prompt], [group[:1]], t.reward, turn_rewards=lambda *a: [1.0], group_size=1,
                    std_norm=False, first_sample_id=0)


def test_a_per_token_advantage_is_the_broadcast_one_when_equal():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(3, 5)
    adv_b = torch.tensor([0.5, -1.0, 2.0])
    per_sample, _, _ = policy_loss_bt(logp, old, adv_b, 0.2, 0.28)
    per_token, _, _ = policy_loss_bt(logp, old, adv_b[:, None].expand(3, 5).clone(), 0.2, 0.28)
    assert torch.equal(per_sample, per_token)
    varied = adv_b[:, None].expand(3, 5).clone()
    varied[:, 3:] = -varied[:, 3:]  # another turn, another sign
    loss, _, _ = policy_loss_bt(logp, old, varied, 0.2, 0.28)
    assert torch.equal(loss[:, :3], per_sample[:, :3]) and not torch.equal(loss[:, 3:], per_sample[:, 3:])


def test_turn_credit_needs_a_task_that_scores_turns():
    with pytest.raises(ValueError, match="algo.turn_credit=true needs a task that scores each model turn; "
                                         "task=repeat_letter"):
        compose("algo.turn_credit=true")
    cfg = compose("task=calculator", "rollout.function=rl.rollout.functions:calculator_tool",
                  "rollout.max_new_tokens=16", "algo.turn_credit=true")
    assert cfg.algo.turn_credit
