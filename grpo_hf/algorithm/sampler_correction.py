"""Importance sampling against the sampler: the completions were not drawn from the policy.

The sampler (our decoder on a bf16 generation copy, through top_p / top_k / min_p; or vLLM) draws
from a distribution pi_sampler that differs from pi_old, the policy the loss assumes. Weighting
each token's policy term by rho = pi_old / pi_sampler, truncated or masked, corrects for it (Yao
et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025; arXiv
2512.02556). The KL and entropy terms are not weighted. Modes (TRL's `vllm_importance_sampling_mode`):

- `token_truncate`: rho_t clipped to [clip_min, clip_max];
- `token_mask`: rho_t, or 0 outside [clip_min, clip_max];
- `sequence_truncate`: the sequence's rho = prod_t rho_t (over its loss tokens) clipped, on each token;
- `sequence_mask`: the sequence's rho, or 0 for all its tokens outside the bounds.

A bound of None is no bound. A token whose sampler log-prob is NaN (vLLM could not score it)
counts as rho_t = 1. Which correction applies (`sampler_correction`): when vLLM generates, TRL's
`vllm_importance_sampling_*` settings (on by default); with our own decoder, `sampler_is_cap`
(token_truncate at that cap; off by default). Either way the sampler's log-probs come from
`Rollout.sampler_logps`, and their distance to the policy's is logged (`sampler_metrics`).
"""

import math
from dataclasses import dataclass

import torch

from grpo_hf.algorithm.policy_terms import Metrics, masked_mean

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class SamplerCorrection:
    """How the importance weights pi_old / pi_sampler are bounded."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0


def sampler_is_weights(
    old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, correction: SamplerCorrection
) -> torch.Tensor:
    """(B, T) importance weights pi_old / pi_sampler bounded as `correction` says; no gradient.

    old_logps, sampler_logps, mask: (B, T). Sequence modes give each token its sequence's weight.
    """
    log_ratio = torch.nan_to_num((old_logps.detach() - sampler_logps) * mask, nan=0.0)  # (B, T)
    if correction.mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    low = -math.inf if correction.clip_min is None else correction.clip_min
    high = math.inf if correction.clip_max is None else correction.clip_max
    if correction.mode.endswith("truncate"):
        return ratio.clamp(low, high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampler_metrics(
    old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None
) -> Metrics:
    """How far the sampler is from the policy, over the active tokens it scored, and the weights.

    Ours: `sampler/ratio_mean`, `sampler/ratio_min`, `sampler/ratio_max` of rho = pi_old / pi_sampler,
    and `sampler/kl`, the token mean of k3 = rho - 1 - log rho: an unbiased, never negative estimate
    of KL(pi_sampler || pi_old) per token from the sampler's own draws (Schulman's k3; TRL logs no
    such KL). TRL's:
    `sampling/sampling_logp_difference/mean` and `/max` of |log pi_old - log pi_sampler|, and
    with a correction `sampling/importance_sampling_ratio/min`, `/mean`, `/max` of the weights
    applied. Extremes of an empty batch are -inf / inf (not recorded).
    """
    scored = mask.bool() & ~sampler_logps.isnan()  # (B, T)
    log_ratio = (old_logps.detach() - sampler_logps).masked_fill(~scored, 0.0)  # (B, T)
    ratio, difference, active = torch.exp(log_ratio), log_ratio.abs(), scored.to(old_logps.dtype)
    metrics = {
        "sampler/ratio_mean": masked_mean(ratio, active),
        "sampler/ratio_min": ratio.masked_fill(~scored, math.inf).min(),
        "sampler/ratio_max": ratio.masked_fill(~scored, -math.inf).max(),
        "sampler/kl": masked_mean(torch.expm1(log_ratio) - log_ratio, active),  # expm1: exact near rho = 1
        "sampling/sampling_logp_difference/mean": masked_mean(difference, active),
        "sampling/sampling_logp_difference/max": difference.masked_fill(~scored, -math.inf).max(),
    }
    if weights is not None:
        loss_tokens = mask.bool()  # (B, T)
        metrics |= {
            "sampling/importance_sampling_ratio/min": weights.masked_fill(~loss_tokens, math.inf).min(),
            "sampling/importance_sampling_ratio/mean": masked_mean(weights, mask.to(weights.dtype)),
            "sampling/importance_sampling_ratio/max": weights.masked_fill(~loss_tokens, -math.inf).max(),
        }
    return metrics
