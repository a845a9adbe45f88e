"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl.algo import grpo_advantages, kl_k3, policy_loss, token_logprobs


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
