"""The learner's loss math: the PPO clipped loss, KL estimators, entropy and loss
aggregation (the GRPO advantages are computed on the rollout side: ``rl.rollout.batch``).

Shapes are in the names: ``_b`` per sample, ``_bt`` per sample and token position.
"""

from __future__ import annotations

import torch

from rl.config import KL_ESTIMATORS, LOSS_AGGS  # listed there: validating a config needs no torch


def policy_loss_bt(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, adv_b: torch.Tensor,
                   clip_low: float, clip_high: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: ``(loss_bt, clipped_bt, approx_kl_bt)``.

    ``ratio = exp(logp - old_logp)``; ``loss = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``;
    ``clipped_bt`` is 1 where the clipped branch won (no gradient flows there);
    ``approx_kl_bt`` is the k3 estimate of KL(behaviour || current) from tokens the behaviour
    policy sampled, ``ratio - 1 - log(ratio)`` (both without gradient).
    """
    ratio_bt = torch.exp(logp_bt - old_logp_bt)
    adv_bt = adv_b[:, None].expand_as(logp_bt)
    unclipped_bt = -adv_bt * ratio_bt
    clipped_loss_bt = -adv_bt * ratio_bt.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_bt = torch.maximum(unclipped_bt, clipped_loss_bt)
    with torch.no_grad():
        clipped_bt = (clipped_loss_bt > unclipped_bt).to(logp_bt.dtype)
        approx_kl_bt = kl_penalty_bt(old_logp_bt, logp_bt, "k3")
    return loss_bt, clipped_bt, approx_kl_bt


def policy_loss(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, adv_b: torch.Tensor,
                mask_bt: torch.Tensor, clip_low: float, clip_high: float
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss_bt`` summed over masked tokens (``mask_bt`` may carry weights):
    ``(loss_sum, {"clipped": ..., "approx_kl": ...})``."""
    loss_bt, clipped_bt, approx_kl_bt = policy_loss_bt(logp_bt, old_logp_bt, adv_b, clip_low, clip_high)
    mask_bt = mask_bt.to(logp_bt.dtype)
    return (loss_bt * mask_bt).sum(), {"clipped": (clipped_bt * mask_bt).sum(),
                                       "approx_kl": (approx_kl_bt * mask_bt).sum()}


def kl_penalty_bt(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of sampled tokens:
    ``k1 = logp - ref_logp`` (unbiased, can be negative); ``k3 = exp(ref - logp) - 1 - (ref - logp)``
    (unbiased, always >= 0, lower variance; Schulman's estimators)."""
    if estimator == "k1":
        return logp_bt - ref_logp_bt
    if estimator == "k3":
        log_r_bt = ref_logp_bt - logp_bt
        return torch.exp(log_r_bt) - 1 - log_r_bt
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


def kl_k3(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Sum over masked tokens of the k3 estimator of KL(policy || reference) (always >= 0)."""
    return (kl_penalty_bt(logp_bt, ref_logp_bt, "k3") * mask_bt.to(logp_bt.dtype)).sum()


def entropy_bt(logits_btv: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the temperature-scaled next-token distribution at every position."""
    logits_btv = logits_btv.float()
    if temperature > 0:
        logits_btv = logits_btv / temperature
    logp_btv = torch.log_softmax(logits_btv, dim=-1)
    return -(logp_btv.exp() * logp_btv).sum(-1)


def agg_sum(x_bt: torch.Tensor, mask_bt: torch.Tensor, mode: str, max_len: int) -> torch.Tensor:
    """This micro-batch's share of an aggregated loss; divide the sum of shares over every
    micro-batch and rank by the sum of ``agg_count`` to get the loss:

    - ``token_mean``: sum of token losses / number of loss tokens (every token weighs the same);
    - ``seq_mean_token_mean``: mean over sequences of each sequence's token mean;
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): sum of token losses / (sequences * ``max_len``),
      a constant per-token weight, free of the length bias of both means.

    ``mask_bt`` may carry per-token weights; a sequence counts when its mask is not all zero.
    """
    mask_bt = mask_bt.to(x_bt.dtype)
    if mode == "token_mean":
        return (x_bt * mask_bt).sum()
    if mode == "seq_mean_token_mean":
        tokens_b = (mask_bt != 0).sum(-1).clamp(min=1).to(x_bt.dtype)
        return ((x_bt * mask_bt).sum(-1) / tokens_b).sum()
    if mode == "seq_mean_token_sum_norm":
        return (x_bt * mask_bt).sum() / max_len
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGS}")


def agg_count(mask_bt: torch.Tensor, mode: str) -> float:
    """The denominator share of ``agg_sum``: loss tokens (``token_mean``) or sequences with
    at least one loss token (the sequence-level modes)."""
    if mode == "token_mean":
        return float((mask_bt != 0).sum())
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return float(((mask_bt != 0).sum(-1) > 0).sum())
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGS}")


def token_logprobs(logits_btv: torch.Tensor, targets_bt: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """log p(target) under the temperature-scaled distribution (what the engines report)."""
    logits_btv = logits_btv.float()
    if temperature > 0:
        logits_btv = logits_btv / temperature
    logz_bt = torch.logsumexp(logits_btv, dim=-1)
    return logits_btv.gather(-1, targets_bt[..., None]).squeeze(-1) - logz_bt
