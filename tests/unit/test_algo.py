"""GRPO math against hand-computed values, and the off-policy correction's (importance weights
against the engines' log-probs: masks, truncation, ESS, KL)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl.algo import (IS_STAT_LOG_BOUND, agg_count, agg_sum, effective_sample_size, entropy_bt,
                     is_keep_bt, is_log_ratio_bt, is_stat_sums, is_weight_bt, kl_k3, kl_penalty_bt,
                     policy_loss, policy_loss_bt, seq_log_ratio_b, token_logprobs)
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


# -- off-policy correction: importance weights w = exp(logp_learner - logp_engine) -----------
def test_ess_of_equal_weights_is_one_and_of_one_dominant_weight_about_one_over_n():
    n = 100
    for w in (1.0, 0.3, 7.0):  # any equal weights, not only the on-policy 1
        assert effective_sample_size(n * w, n * w * w, n) == pytest.approx(1.0)
    # one weight 1e6, 99 weights 1: (1e6 + 99)^2 / (100 * (1e12 + 99)) = 0.0100019...
    big = 1e6
    ess = effective_sample_size(big + 99, big * big + 99, n)
    assert ess == pytest.approx((big + 99) ** 2 / (n * (big * big + 99)), rel=1e-12)
    assert ess == pytest.approx(1 / n, rel=1e-3)
    # two weights 1 and 3: (4)^2 / (2 * 10) = 0.8
    assert effective_sample_size(4.0, 10.0, 2) == pytest.approx(0.8)
    assert effective_sample_size(0.0, 0.0, 0) == 1.0  # nothing to weigh


def test_log_ratio_is_zero_outside_loss_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    engine = torch.tensor([[-1.5, 0.0, 90.0]])  # the pad position's value must never count
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(is_log_ratio_bt(logp, engine, mask), torch.tensor([[0.5, -2.0, 0.0]]))


# Three sequences of 4 positions; token ratios w written out (log ratios are their logs), loss
# tokens marked by MASK: sequence 0 has 4, sequence 1 has 2 then padding (whose ratio, 100,
# must not count), sequence 2 has 3 with its second masked out of the loss by the rollout.
W_BT = torch.tensor([[1.0, 3.0, 0.4, 1.0],
                     [1.5, 1.5, 100.0, 100.0],
                     [0.9, 0.01, 1.1, 1.0]], dtype=torch.float64)
IS_MASK_BT = torch.tensor([[1.0, 1.0, 1.0, 1.0],
                           [1.0, 1.0, 0.0, 0.0],
                           [1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)


def test_sequence_ratio_is_the_geometric_mean_over_loss_tokens():
    seq = seq_log_ratio_b(W_BT.log(), IS_MASK_BT).exp()
    # (1 * 3 * 0.4 * 1)^(1/4) = 1.2^(1/4); (1.5 * 1.5)^(1/2) = 1.5; (0.9 * 1.1)^(1/2) = 0.99^(1/2)
    torch.testing.assert_close(seq, torch.tensor([1.2 ** 0.25, 1.5, 0.99 ** 0.5], dtype=torch.float64))
    # no loss token: log ratio 0 (ratio 1), not a division by zero
    assert seq_log_ratio_b(W_BT.log(), torch.zeros_like(IS_MASK_BT)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode,low,high,keep", [
    ("none", 0.5, 2.0, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]),
    # token: w = 3 > 2 and 0.4 < 0.5 out; 0.01 is out of the band but not a loss token anyway
    ("token", 0.5, 2.0, [[1, 0, 0, 1], [1, 1, 1, 1], [1, 0, 1, 1]]),
    # the band is inclusive: 1.5 is kept at high 1.5, 0.9 at low 0.9
    ("token", 0.9, 1.5, [[1, 0, 0, 1], [1, 1, 1, 1], [1, 0, 1, 1]]),
    ("token", 0.0, 1.2, [[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]),
    # sequence: geometric means 1.04664, 1.5, 0.99499; [0.99, 1.1] drops sequence 1 only
    ("sequence", 0.99, 1.1, [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]),
    # [0.994, 1.04] drops sequence 0 (1.0466 > 1.04) and 1, keeps 2 (0.99499 >= 0.994)
    ("sequence", 0.994, 1.04, [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
    ("sequence", 0.5, 2.0, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]),
])
def test_is_mask_masks_exactly_the_tokens_or_sequences_out_of_the_band(mode, low, high, keep):
    log_w = is_log_ratio_bt(W_BT.log(), torch.zeros_like(W_BT), IS_MASK_BT)
    got = is_keep_bt(log_w, IS_MASK_BT, mode, low, high)
    # outside the loss tokens the value does not matter (the mask zeroes it): compare there only
    want = torch.tensor(keep, dtype=torch.float64)
    assert (got * IS_MASK_BT).tolist() == (want * IS_MASK_BT).tolist()


def test_is_mask_never_overflows_on_huge_ratios():
    log_w = torch.tensor([[500.0, -500.0, 0.0]])  # exp overflows float32 (and float64)
    mask = torch.ones(1, 3)
    assert is_keep_bt(log_w, mask, "token", 0.5, 2.0).tolist() == [[0.0, 0.0, 1.0]]
    assert is_keep_bt(log_w, mask, "sequence", 0.5, 2.0).tolist() == [[1.0, 1.0, 1.0]]  # mean 0
    with pytest.raises(ValueError, match="unknown importance-sampling mask 'seq'"):
        is_keep_bt(log_w, mask, "seq", 0.5, 2.0)


@pytest.mark.parametrize("mode,share", [
    # the token at X_BT[0, 1] (value 2) is masked: 1 + 4 + 5 + 6 = 16, still over 5 loss tokens
    ("token_mean", 16.0),
    # its sequence's mean keeps its 3 loss tokens: (1 + 4) / 3 + (5 + 6) / 2
    ("seq_mean_token_mean", 5 / 3 + 11 / 2),
    ("seq_mean_token_sum_norm", 16 / 8),
])
def test_masked_tokens_stay_in_the_normaliser(mode, share):
    """The learner multiplies the token losses by the importance weight and aggregates over
    the rollout's loss mask: a masked token adds 0 and still counts, per batch and per sequence."""
    keep = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert agg_sum(X_BT * keep, MASK_BT, mode, max_len=8).item() == pytest.approx(share, rel=1e-6)
    assert agg_count(MASK_BT, mode) == (5.0 if mode == "token_mean" else 2.0)


def test_is_weight_masks_first_then_truncates_the_rest():
    log_w = W_BT.log()
    keep = is_keep_bt(log_w, IS_MASK_BT, "token", 0.5, 2.0)
    # no cap: the weight is the mask alone
    assert is_weight_bt(log_w, keep, 0.0).tolist() == keep.tolist()
    # cap 1.2: kept tokens weigh min(w, 1.2); masked ones 0 (3.0 is masked, not capped)
    torch.testing.assert_close(is_weight_bt(log_w, keep, 1.2) * IS_MASK_BT, torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [1.2, 1.2, 0.0, 0.0], [0.9, 0.0, 1.1, 0.0]], dtype=torch.float64))
    # truncation alone (nothing masked): 3.0 -> 1.2, and an overflowing ratio is capped too
    ones = torch.ones_like(W_BT)
    assert is_weight_bt(log_w, ones, 1.2)[0].tolist() == pytest.approx([1.0, 1.2, 0.4, 1.0])
    assert is_weight_bt(torch.tensor([[500.0]]), torch.ones(1, 1), 2.0).tolist() == [[2.0]]


def test_is_stat_sums_by_hand():
    log_w = W_BT.log()
    keep = is_keep_bt(log_w, IS_MASK_BT, "token", 0.5, 2.0)
    s = is_stat_sums(log_w, IS_MASK_BT, keep, tis_cap=1.2)
    loss_w = [1.0, 3.0, 0.4, 1.0, 1.5, 1.5, 0.9, 1.1]  # the 8 loss tokens' ratios
    assert s["is_n"] == 8
    assert s["is_w"] == pytest.approx(sum(loss_w))
    assert s["is_w2"] == pytest.approx(sum(w * w for w in loss_w))
    assert s["is_max"] == pytest.approx(3.0)  # not the padding's 100
    assert s["is_masked"] == 2  # 3.0 and 0.4
    assert s["is_truncated"] == 2  # 1.5 and 1.5 (3.0 is masked, not truncated)
    # k3 of KL(engine || learner): w - 1 - ln w per token
    assert s["engine_kl"] == pytest.approx(sum(w - 1 - math.log(w) for w in loss_w))
    assert is_stat_sums(log_w, IS_MASK_BT, keep, tis_cap=0.0)["is_truncated"] == 0  # TIS off
    # on-policy: every ratio 1, ESS 1, KL 0
    on = is_stat_sums(torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3), 2.0)
    assert (on["is_w"], on["is_w2"], on["is_n"], on["is_max"], on["engine_kl"]) == (6, 6, 6, 1, 0)
    assert effective_sample_size(on["is_w"], on["is_w2"], on["is_n"]) == 1.0


def test_is_stat_sums_stay_finite_on_huge_ratios():
    """A ratio of e^96 (engine log-prob -100 where the learner has -4) neither overflows the
    sums nor makes the ESS NaN: log ratios are clamped for the statistics."""
    log_w = torch.tensor([[96.0, 0.0, 0.0, -300.0]])
    s = is_stat_sums(log_w, torch.ones(1, 4), torch.ones(1, 4), 2.0)
    assert all(math.isfinite(v) for v in s.values())
    assert s["is_max"] == pytest.approx(math.exp(IS_STAT_LOG_BOUND))
    assert s["is_truncated"] == 1  # compared unclamped
    assert effective_sample_size(s["is_w"], s["is_w2"], s["is_n"]) == pytest.approx(1 / 4, rel=1e-6)
