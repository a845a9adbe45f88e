"""GRPO math: group-normalised advantages and the token-level PPO clipped loss.

Shapes are in the names: ``_b`` per sample, ``_bt`` per sample and token position.
"""

from __future__ import annotations

import numpy as np
import torch


def grpo_advantages(rewards: np.ndarray, group_size: int, std_norm: bool = True,
                    eps: float = 1e-6) -> np.ndarray:
    """(r - mean of its group) / (std of its group + eps); groups are consecutive runs of
    ``group_size`` samples. A group whose rewards are all equal gets zero advantage."""
    r_gn = rewards.reshape(-1, group_size).astype(np.float64)
    adv_gn = r_gn - r_gn.mean(axis=1, keepdims=True)
    if std_norm:
        adv_gn = adv_gn / (r_gn.std(axis=1, keepdims=True) + eps)  # population std
    return adv_gn.reshape(-1).astype(np.float32)


def policy_loss(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, adv_b: torch.Tensor,
                mask_bt: torch.Tensor, clip_low: float, clip_high: float
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, summed over masked tokens (the caller normalises).

    Returns ``(loss_sum, stats)`` where ``stats`` holds sums over masked tokens
    (``clipped``: tokens whose ratio was clipped, ``approx_kl``: k3 of old vs new).
    """
    ratio_bt = torch.exp(logp_bt - old_logp_bt)
    adv_bt = adv_b[:, None].expand_as(logp_bt)
    unclipped_bt = -adv_bt * ratio_bt
    clipped_bt = -adv_bt * ratio_bt.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_bt = torch.maximum(unclipped_bt, clipped_bt)
    mask_bt = mask_bt.to(logp_bt.dtype)
    with torch.no_grad():
        was_clipped_bt = (clipped_bt > unclipped_bt).to(logp_bt.dtype)
        log_r_bt = old_logp_bt - logp_bt
        approx_kl_bt = torch.exp(log_r_bt) - 1 - log_r_bt
    return (loss_bt * mask_bt).sum(), {
        "clipped": (was_clipped_bt * mask_bt).sum(),
        "approx_kl": (approx_kl_bt * mask_bt).sum(),
    }


def kl_k3(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Sum over masked tokens of the k3 estimator of KL(policy || reference) (always >= 0)."""
    log_r_bt = ref_logp_bt - logp_bt
    return ((torch.exp(log_r_bt) - 1 - log_r_bt) * mask_bt.to(logp_bt.dtype)).sum()


def token_logprobs(logits_btv: torch.Tensor, targets_bt: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """log p(target) under the temperature-scaled distribution (what the engines report)."""
    logits_btv = logits_btv.float()
    if temperature > 0:
        logits_btv = logits_btv / temperature
    logz_bt = torch.logsumexp(logits_btv, dim=-1)
    return logits_btv.gather(-1, targets_bt[..., None]).squeeze(-1) - logz_bt
