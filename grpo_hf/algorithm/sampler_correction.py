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

The truncated support (TRL 1.17's behaviour, `renormalize_truncated_sampling`). Under top_k /
top_p / min_p both samplers (our decoder; vLLM with logprobs_mode='processed_logprobs') record the
log-probs of the distribution they drew from, renormalised over the tokens the truncation kept,
log(p_t / S) with S the kept mass, while the trainer's are over the whole vocabulary. Compared as
they are, every token's rho carries S <= 1 besides any real mismatch, and a sequence's rho the
product of its tokens' S: the sequence modes then shrink or mask most of the gradient. So the
trainer replays the truncation on its own distribution (`Truncation`, `kept_floor`: the engine's
log-prob pass takes the log of the mass pi_old keeps, the drawn token always included) and the
sampler's log-probs are compared on that support (`on_policy_support`): rho = (pi_old / S_old) /
pi_sampler. The replay is exact up to ties and rounding at the cut: the sampler's own kept set is
not recorded (vLLM returns it only from 0.28 on, with --return-sampling-mask).
"""

import math
from dataclasses import dataclass

import torch

from grpo_hf.algorithm.policy_terms import Metrics, masked_mean

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class Truncation:
    """What the sampler cut from each token's distribution (over logits / temperature): top_k (0: off),
    top_p (1: off), min_p (0: off); `min_p_first` as vLLM, which applies min_p before top_k and top_p
    (transformers and our decoder apply it after them)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_p_first: bool = False


def kept_floor(z: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """(c,) the smallest score each row of z (c, V) keeps under `truncation`, as transformers' and
    vLLM's warpers cut: top_k the k largest (ties kept), top_p the likeliest tokens until the mass
    of those before reaches top_p, min_p those with p >= min_p * max p; each of top_k, top_p and
    min_p acting on what the ones before it kept. A token is kept when its score is at least the floor.
    """
    floor = z.new_full(z.shape[:1], -math.inf)  # (c,)
    if truncation.min_p > 0 and truncation.min_p_first:
        floor = torch.maximum(floor, z.amax(dim=-1) + math.log(truncation.min_p))
    if 0 < truncation.top_k < z.shape[-1]:
        floor = torch.maximum(floor, z.topk(truncation.top_k, dim=-1).values[:, -1])
    if truncation.top_p < 1.0:
        ordered = z.masked_fill(z < floor.unsqueeze(-1), -math.inf).sort(dim=-1, descending=True).values
        probs = ordered.softmax(dim=-1)  # (c, V) renormalised over what is kept so far
        before = probs.cumsum(dim=-1) - probs  # (c, V) mass of the likelier tokens
        count = (before < truncation.top_p).sum(dim=-1, keepdim=True)  # (c, 1) at least 1
        floor = torch.maximum(floor, ordered.gather(-1, count - 1).squeeze(-1))
    if truncation.min_p > 0 and not truncation.min_p_first:
        floor = torch.maximum(floor, z.amax(dim=-1) + math.log(truncation.min_p))
    return floor


def on_policy_support(inputs: dict, kept_log_mass: torch.Tensor | None) -> dict:
    """`inputs` with its `sampler_logps` (B, T) put on the policy's scale, log pi_sampler + log S_old
    with `kept_log_mass` (B, T) = log S_old, so that every comparison with a policy log-prob is one
    of log(pi / S_old) with the sampler's; unchanged without either."""
    if kept_log_mass is None or inputs.get("sampler_logps") is None:
        return inputs
    return inputs | {"sampler_logps": inputs["sampler_logps"] + kept_log_mass}


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
    """How far the sampler is from the policy, over the active tokens it scored, and the weights
    (under a truncation, with the sampler's log-probs on pi_old's support: `on_policy_support`).

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
