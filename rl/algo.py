"""The learner's loss math: the PPO clipped loss, KL estimators, entropy, loss aggregation,
and the off-policy correction against the engines' log-probs (truncated and masked importance
sampling, with its diagnostics). The GRPO advantages are computed on the rollout side:
``rl.rollout.batch``.

Shapes are in the names: ``_b`` per sample, ``_bt`` per sample and token position.
"""

from __future__ import annotations

import math

import torch

from rl.config import IS_MASKS, KL_ESTIMATORS, LOSS_AGGS  # listed there: validating a config needs no torch


def policy_loss_bt(logp_bt: torch.Tensor, old_logp_bt: torch.Tensor, adv_b: torch.Tensor,
                   clip_low: float, clip_high: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: ``(loss_bt, clipped_bt, approx_kl_bt)``.

    ``ratio = exp(logp - old_logp)``; ``loss = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``,
    ``A`` one advantage a sample (``adv_b`` [B], broadcast over its tokens) or one a token ([B, T]);
    ``clipped_bt`` is 1 where the clipped branch won (no gradient flows there);
    ``approx_kl_bt`` is the k3 estimate of KL(behaviour || current) from tokens the behaviour
    policy sampled, ``ratio - 1 - log(ratio)`` (both without gradient).
    """
    ratio_bt = torch.exp(logp_bt - old_logp_bt)
    adv_bt = adv_b[:, None].expand_as(logp_bt) if adv_b.dim() == 1 else adv_b
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


# -- off-policy correction: learner (behaviour) vs engine log-probs ----------------------------
IS_STAT_LOG_BOUND = 20.0
"""The importance-sampling statistics clamp log ratios to +-this (as verl's rollout correction
does): one token the engine found e^-100 times less likely than the learner must not turn the
sums into inf or the ESS into NaN; ``train/is_weight_max`` reads at most e^20 (about 4.9e8)."""


def is_log_ratio_bt(logp_bt: torch.Tensor, engine_logp_bt: torch.Tensor,
                    mask_bt: torch.Tensor) -> torch.Tensor:
    """``log w = logp - engine_logp`` at loss tokens, 0 (ratio 1) elsewhere, so that no pad
    position ever reaches an ``exp``."""
    return torch.where(mask_bt != 0, logp_bt - engine_logp_bt, torch.zeros_like(logp_bt))


def seq_log_ratio_b(log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Each sequence's log ratio: the mean of its tokens' log ratios over its loss tokens, i.e.
    the log of the geometric mean of their ratios (length-normalised: the product of the
    ratios would punish long answers for their length alone); 0 without loss tokens."""
    loss_bt = (mask_bt != 0).to(log_ratio_bt.dtype)
    return (log_ratio_bt * loss_bt).sum(-1) / loss_bt.sum(-1).clamp(min=1)


def is_keep_bt(log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, mode: str, low: float,
               high: float) -> torch.Tensor:
    """Masked importance sampling: 1 where a token stays in the policy loss, 0 where it is
    masked out. ``token``: its ratio ``w`` is outside ``[low, high]``; ``sequence``: its
    sequence's geometric-mean ratio (``seq_log_ratio_b``) is; ``none``: nothing is masked.
    Compared in log space, so a huge ratio never overflows; the band is inclusive."""
    if mode == "none":
        return torch.ones_like(log_ratio_bt)
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high)
    if mode == "token":
        x = log_ratio_bt
    elif mode == "sequence":
        x = seq_log_ratio_b(log_ratio_bt, mask_bt)[:, None].expand_as(log_ratio_bt)
    else:
        raise ValueError(f"unknown importance-sampling mask {mode!r}; use one of {IS_MASKS}")
    return ((x >= log_low) & (x <= log_high)).to(log_ratio_bt.dtype)


def is_weight_bt(log_ratio_bt: torch.Tensor, keep_bt: torch.Tensor, tis_cap: float) -> torch.Tensor:
    """The weight of each token's policy loss: masked first (``keep_bt``), then the rest
    truncated at ``tis_cap`` (``min(w, tis_cap)``; 0 = no truncation, weight 1)."""
    if tis_cap <= 0:
        return keep_bt
    return keep_bt * torch.exp(log_ratio_bt).clamp(max=tis_cap)  # exp -> inf is capped too


def is_stat_sums(log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, keep_bt: torch.Tensor,
                 tis_cap: float) -> dict[str, float]:
    """Sums over the loss tokens (``mask_bt != 0``) of the raw ratio ``w = exp(log_ratio)``,
    to be added over micro-batches and ranks (``is_max``: take the max), in float64 with log
    ratios clamped to +-``IS_STAT_LOG_BOUND``:

    - ``is_w``, ``is_w2``, ``is_n``, ``is_max``: sum of w, sum of w^2, loss tokens, largest w
      (0 without loss tokens);
    - ``is_truncated``: tokens kept by the mask whose w exceeds ``tis_cap`` (0 when TIS is off);
    - ``is_masked``: tokens ``keep_bt`` masks out;
    - ``engine_kl``: sum of the k3 estimate of KL(engine || learner) from the engines' samples,
      ``w - 1 - log w`` (each term >= 0; its mean is unbiased since ``E_engine[w] = 1``).
    """
    loss_bt = mask_bt != 0
    raw = log_ratio_bt.detach()[loss_bt].double()
    log_w = raw.clamp(-IS_STAT_LOG_BOUND, IS_STAT_LOG_BOUND)
    keep = keep_bt.detach()[loss_bt] != 0
    w = torch.exp(log_w)
    return {"is_w": float(w.sum()), "is_w2": float((w * w).sum()), "is_n": float(w.numel()),
            "is_max": float(w.max()) if w.numel() else 0.0,
            "is_truncated": float((keep & (raw > math.log(tis_cap))).sum()) if tis_cap > 0 else 0.0,
            "is_masked": float((~keep).sum()),
            "engine_kl": float((w - 1 - log_w).sum())}


def effective_sample_size(sum_w: float, sum_w2: float, n: float) -> float:
    """Normalised effective sample size of importance weights, ``(sum w)^2 / (n * sum w^2)``, in
    (0, 1]: 1 when every weight is equal (on-policy), about 1/n when one weight dominates.
    1 when there is nothing to weigh (n = 0)."""
    if n <= 0 or sum_w2 <= 0:
        return 1.0
    return sum_w * sum_w / (n * sum_w2)
