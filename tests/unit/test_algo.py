"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl.algo import (agg_count, agg_sum, entropy_bt, kl_k3, kl_penalty_bt, policy_loss,
                     policy_loss_bt, token_logprobs)
from rl.rollout.batch import grpo_advantages


def test_advantages_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=np.float32)
    adv = grpo_advantages(rewards, group_size=4, eps=0.0 + 1e-12)
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
    centred = grpo_advantages(rewards, group_size=4, std_norm=False)
    np.testing.assert_allclose(centred, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-6)


def test_advantages_single_outlier():
    adv = grpo_advantages(np.array([3.0, 0, 0], dtype=np.float32), group_size=3, eps=1e-6)
    mean, std = 1.0, math.sqrt(((2) ** 2 + 1 + 1) / 3)
    np.testing.assert_allclose(adv, [(3 - mean) / (std + 1e-6), -mean / (std + 1e-6),
                                     -mean / (std + 1e-6)], rtol=1e-5)


def test_policy_loss_by_hand():
    # two tokens of one sample, advantage +1: ratios exp(0.5)=1.6487 and exp(-0.5)=0.6065
    logp = torch.tensor([[0.0, -1.0]])
    old = torch.tensor([[-0.5, -0.5]])
    adv = torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0]])
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # token 1: max(-1.6487, -1.2) = -1.2 (clipped); token 2: max(-0.6065, -0.8) = -0.6065
    assert loss.item() == pytest.approx(-1.2 - math.exp(-0.5), rel=1e-5)
    assert stats["clipped"].item() == 1.0


def test_policy_loss_negative_advantage_and_mask():
    logp = torch.tensor([[0.0, -1.0, 5.0]])
    old = torch.tensor([[-0.5, -0.5, 0.0]])
    adv = torch.tensor([-2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is masked: never counts
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    # token 1: max(2*1.6487, 2*1.3) = 3.2974 ; token 2: max(2*0.6065, 2*0.8) = 1.6 (clipped)
    assert loss.item() == pytest.approx(2 * math.exp(0.5) + 1.6, rel=1e-5)
    assert stats["clipped"].item() == 1.0


def test_policy_gradient_at_ratio_one():
    # With old = logp.detach(), d loss / d logp = -adv on every unmasked token.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([0.7]), torch.tensor([[1.0, 1.0, 0.0]]),
                          0.2, 0.2)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[-0.7, -0.7, 0.0]], atol=1e-6)


def test_kl_k3_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    # log r = ref - logp = -0.5 ; k3 = e^-0.5 - 1 + 0.5
    assert kl_k3(logp, ref, mask).item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-6)
    assert kl_k3(ref, ref, mask).item() == 0.0


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    got = token_logprobs(logits, targets, temperature)
    t = temperature if temperature > 0 else 1.0
    want = torch.log_softmax(logits / t, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want)


# -- loss aggregation ----------------------------------------------------------------------
# Three sequences padded to 4 positions, max_len (rollout.max_new_tokens) 8 -- the padded
# width must not stand in for it: the first has 4 positions with its third token masked out, the
# second 2 loss tokens then padding, the third no loss token at all (every mask zero).
X_BT = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                     [5.0, 6.0, 9.0, 9.0],
                     [7.0, 7.0, 7.0, 7.0]])
MASK_BT = torch.tensor([[1.0, 1.0, 0.0, 1.0],
                        [1.0, 1.0, 0.0, 0.0],
                        [0.0, 0.0, 0.0, 0.0]])
WEIGHT_BT = torch.tensor([[0.5, 2.0, 0.0, 1.0],
                          [1.0, 3.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,mask,share,count", [
    # token_mean: 1 + 2 + 4 + 5 + 6 = 18 over 5 loss tokens
    ("token_mean", MASK_BT, 18.0, 5.0),
    # seq_mean_token_mean: (1 + 2 + 4) / 3 + (5 + 6) / 2 = 7/3 + 11/2 = 47/6; 2 sequences
    # (the all-masked third neither adds to the sum nor counts)
    ("seq_mean_token_mean", MASK_BT, 47 / 6, 2.0),
    # seq_mean_token_sum_norm: 18 / max_len 8 = 2.25 over 2 sequences -> 18 / (2 * 8)
    ("seq_mean_token_sum_norm", MASK_BT, 2.25, 2.0),
    # weighted: 0.5*1 + 2*2 + 1*4 + 1*5 + 3*6 = 8.5 + 23 = 31.5, still 5 loss tokens
    ("token_mean", WEIGHT_BT, 31.5, 5.0),
    # weighted per-sequence means: 8.5 / 3 + 23 / 2 = 43/3
    ("seq_mean_token_mean", WEIGHT_BT, 43 / 3, 2.0),
    # 31.5 / 8 = 3.9375
    ("seq_mean_token_sum_norm", WEIGHT_BT, 3.9375, 2.0),
])
def test_loss_aggregation_by_hand(mode, mask, share, count):
    assert agg_sum(X_BT, mask, mode, max_len=8).item() == pytest.approx(share, rel=1e-6)
    assert agg_count(mask, mode) == count


@pytest.mark.parametrize("mode,loss", [
    ("token_mean", 18 / 5), ("seq_mean_token_mean", 47 / 12), ("seq_mean_token_sum_norm", 18 / 16)])
def test_loss_aggregation_shares_add_up_over_micro_batches(mode, loss):
    """Sum of shares / sum of counts over any split of the sequences = the whole batch's loss
    (what the learner relies on across micro-batches and ranks)."""
    shares = sum(agg_sum(X_BT[s], MASK_BT[s], mode, 8) for s in (slice(0, 1), slice(1, 3)))
    counts = sum(agg_count(MASK_BT[s], mode) for s in (slice(0, 1), slice(1, 3)))
    assert (shares / counts).item() == pytest.approx(loss, rel=1e-6)


def test_unknown_aggregation_and_estimator_raise():
    with pytest.raises(ValueError, match="unknown loss aggregation 'foo'"):
        agg_sum(X_BT, MASK_BT, "foo", 4)
    with pytest.raises(ValueError, match="unknown loss aggregation 'foo'"):
        agg_count(MASK_BT, "foo")
    with pytest.raises(ValueError, match="unknown KL estimator 'k2'"):
        kl_penalty_bt(X_BT, X_BT, "k2")


# -- KL estimators, entropy ----------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    # k1 = logp - ref = [0.5, -1, 0] (negative where the policy is less likely than the ref)
    torch.testing.assert_close(kl_penalty_bt(logp, ref, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    # k3 with log r = ref - logp = [-0.5, 1, 0]: e^r' - 1 - r' =
    #   e^-0.5 - 1 + 0.5 = 0.1065306597, e - 1 - 1 = 0.7182818285, 1 - 1 - 0 = 0
    torch.testing.assert_close(kl_penalty_bt(logp, ref, "k3"),
                               torch.tensor([[0.1065306597, 0.7182818285, 0.0]]))


def test_entropy_by_hand():
    # position 0: logits [0, ln 2, ln 5] -> softmax [1, 2, 5] / 8 at T=1;
    #   H = 1/8 ln 8 + 2/8 ln 4 + 5/8 ln 8/5 = 0.9002560513
    #   at T=0.5 the logits double -> [1, 4, 25] / 30;
    #   H = 1/30 ln 30 + 4/30 ln 7.5 + 25/30 ln 1.2 = 0.5339616128
    # position 1: equal logits -> uniform at any temperature, H = ln 3 = 1.0986122887
    logits = torch.tensor([[[0.0, math.log(2), math.log(5)], [3.0, 3.0, 3.0]]])
    torch.testing.assert_close(entropy_bt(logits, 1.0), torch.tensor([[0.9002560513, 1.0986122887]]))
    torch.testing.assert_close(entropy_bt(logits, 0.5), torch.tensor([[0.5339616128, 1.0986122887]]))


# -- per-token PPO loss ---------------------------------------------------------------------
def test_policy_loss_per_token_both_clip_sides():
    """clip_low 0.2, clip_high 0.3: the ratio is clipped to [0.8, 1.3]."""
    ratios = torch.tensor([[1.5, 1.25, 1.1, 0.5],    # sample A, advantage +1
                           [0.5, 0.75, 1.25, 1.5]])  # sample B, advantage -2
    old = torch.full((2, 4), -1.0)
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    loss_bt, clipped_bt, approx_kl_bt = policy_loss_bt(logp, old, adv, clip_low=0.2, clip_high=0.3)
    # loss = max(-A r, -A clip(r, 0.8, 1.3)):
    # A:  r=1.5  -> max(-1.5, -1.3)  = -1.3   clipped (upper side)
    #     r=1.25 -> max(-1.25,-1.25) = -1.25  not clipped (it would be with clip_high = 0.2)
    #     r=1.1  -> -1.1, r=0.5 -> max(-0.5, -0.8) = -0.5: below 1 - low, but A > 0 keeps it
    # B:  r=0.5  -> max(1.0, 1.6) = 1.6       clipped (lower side)
    #     r=0.75 -> max(1.5, 1.6) = 1.6       clipped (it would not be with clip_low = 0.3)
    #     r=1.25 -> 2.5, r=1.5 -> max(3.0, 2.6) = 3.0: above 1 + high, but A < 0 keeps it
    torch.testing.assert_close(loss_bt.detach(), torch.tensor([[-1.3, -1.25, -1.1, -0.5],
                                                               [1.6, 1.6, 2.5, 3.0]]))
    assert clipped_bt.tolist() == [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    # approx_kl: k3 of KL(behaviour || current) from behaviour samples: r - 1 - ln r
    #   r = 1.5: 0.0945348919, 1.25: 0.0268564487, 1.1: 0.0046898202, 0.5: 0.1931471806,
    #   0.75: 0.0376820725
    torch.testing.assert_close(approx_kl_bt,
                               torch.tensor([[0.0945348919, 0.0268564487, 0.0046898202, 0.1931471806],
                                             [0.1931471806, 0.0376820725, 0.0268564487, 0.0945348919]]))
    # d loss / d logp = -A r where the unclipped branch wins, 0 where the clip does
    loss_bt.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.25, -1.1, -0.5],
                                                        [0.0, 0.0, 2.5, 3.0]]))
