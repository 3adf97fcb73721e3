"""The GRPO objective as pure tensor functions of per-token log-probs.

Per completion token t of sequence i, with advantage A_i and ratio r = exp(logp - old_logp):

    loss_t = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t - entropy_coef * H_t

- clip-higher `epsilon_high` from DAPO (arXiv 2503.14476); `delta` caps the unclipped ratio from
  above, so a negative advantage cannot push an arbitrarily large ratio (two-sided clipping, as in
  INTELLECT-2, arXiv 2505.07291).
- `importance_sampling_level="sequence"` uses one ratio per sequence,
  exp(mean_t(logp - old_logp)) (GSPO, arXiv 2507.18071); gradients still reach every token.
- KL_t estimates KL(pi || pi_ref) from samples of pi with x = ref_logp - logp (Schulman, "Approximating
  KL divergence", 2020, as in DeepSeekMath arXiv 2402.03300): k1 = -x, k2 = x^2 / 2,
  k3 = exp(x) - x - 1 (unbiased and never negative; the default).
- The entropy bonus (arXiv 2504.20571) is the token entropy of the policy, supplied by the caller.

Aggregation over tokens (`loss_type`):
- `grpo`: mean over each sequence's tokens, then mean over sequences (DeepSeekMath).
- `bnpo`: mean over the micro-batch's active tokens.
- `dr_grpo`: sum / (B * max_completion_length), a constant normaliser (Dr. GRPO, arXiv 2503.20783).
- `dapo`: sum / active tokens of everything that feeds the same optimizer step (DAPO's token-level
  mean: every micro-batch of that step, on every process). The caller passes that count, scaled for
  gradient accumulation and processes, as `dapo_normalizer` (`GRPOTrainer._dapo_normalizers`);
  without it the micro-batch's own count is used, which is exact when one micro-batch is the step.
  With no active token at all the loss is 0 (so are its gradients), not NaN; likewise for the others.

With one pass over each generation round (num_iterations = 1, one optimizer step per round),
old_logp is the current log-prob detached: the ratio is exactly 1, the clip never binds, and the
loss value is -mean(A) + beta * KL (about 0 with normalised advantages) while the gradient is the
policy gradient A * grad log pi. A logged loss near 0 is therefore expected, not a bug.
"""

import torch

Metrics = dict[str, torch.Tensor]


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi; same shape."""
    x = ref_logps - logps  # (B, T) log(pi_ref / pi)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return x.pow(2) / 2
    if estimator == "k3":
        # exp(x) - x - 1 as expm1(x) - x: in float32 the former rounds to -6e-8 near x = 0.
        return torch.expm1(x) - x
    raise ValueError(f"kl_estimator={estimator!r} is not one of ('k1', 'k2', 'k3').")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; 0 for an empty mask."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def importance_log_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log(pi / pi_old) per token, or the per-sequence mean broadcast over tokens (GSPO)."""
    log_ratio = logps - old_logps  # (B, T)
    if level == "token":
        return log_ratio
    if level == "sequence":
        per_seq = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        return per_seq.unsqueeze(1).expand_as(log_ratio)  # (B, T)
    raise ValueError(f"importance_sampling_level={level!r} is not one of ('token', 'sequence').")


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """Per-token min(r * A, clip(r) * A) with r = exp(log_ratio); advantages (B,) broadcast over T."""
    ratio = torch.exp(log_ratio)  # (B, T)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    adv = advantages.unsqueeze(1)  # (B, 1)
    clipped = torch.clamp(torch.exp(log_ratio), 1 - epsilon, 1 + epsilon_high)  # (B, T)
    return torch.min(ratio * adv, clipped * adv)  # (B, T)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int,
    dapo_normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar according to `loss_type`."""
    masked = per_token * mask  # (B, T)
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    if loss_type == "dapo":
        normalizer = torch.as_tensor(
            mask.sum() if dapo_normalizer is None else dapo_normalizer,
            dtype=masked.dtype,
            device=masked.device,
        )
        # No active token at all (e.g. every completion truncated and masked): loss 0, not 0 / 0.
        return masked.sum() / torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer))
    raise ValueError(f"loss_type={loss_type!r} is not one of ('grpo', 'bnpo', 'dr_grpo', 'dapo').")


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    dapo_normalizer: float | None = None,
    sampler_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The GRPO loss of one micro-batch and its metrics (detached scalars).

    logps, old_logps, ref_logps, entropy, completion_mask: (B, T) over completion tokens;
    advantages: (B,). `old_logps=None` means "same policy": logps detached. `ref_logps` may be
    None only when beta = 0. `sampler_weights` (B, T), no gradient: per-token importance weights
    for the policy term, the truncated ratio of old policy to sampler (`sampler_is_weights`).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    max_completion_length = logps.shape[1] if max_completion_length is None else max_completion_length
    mask = completion_mask.to(logps.dtype)  # (B, T)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = importance_log_ratio(logps, old_logps, mask, importance_sampling_level)  # (B, T)
    per_token = -clipped_surrogate(log_ratio, advantages, epsilon, epsilon_high, delta)  # (B, T)
    if sampler_weights is not None:
        per_token = per_token * sampler_weights
    metrics = _clip_metrics(log_ratio.detach(), advantages, mask, epsilon, epsilon_high)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps.")
        kl = kl_estimate(logps, ref_logps, kl_estimator)  # (B, T)
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        if entropy_coef != 0.0:
            per_token = per_token - entropy_coef * entropy
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    loss = aggregate(per_token, mask, loss_type, max_completion_length, dapo_normalizer)
    return loss, metrics


def _clip_metrics(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float, epsilon_high: float
) -> Metrics:
    """Fractions of active tokens where the clip binds: below (A < 0) and above (A > 0)."""
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1)
    low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)  # (B, T)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)  # (B, T)
    return {
        "clip_ratio/low": masked_mean(low, mask),
        "clip_ratio/high": masked_mean(high, mask),
        "clip_ratio/region": masked_mean(low + high, mask),
    }


def sampler_is_weights(old_logps: torch.Tensor, sampler_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling, token level: min(pi_old / pi_sampler, cap), (B, T), no grad.

    The completions were drawn by the sampler (a bf16 copy, through top_p / top_k / min_p), whose
    distribution differs from the policy the loss assumes; weighting the policy-gradient term by
    this capped ratio corrects for it (Yao et al., "Your efficient RL framework secretly brings
    you off-policy RL training", 2025). The KL and entropy terms are not weighted.
    """
    return torch.exp(old_logps.detach() - sampler_logps).clamp(max=cap)


def adaptive_beta(beta: float, kl: float, target_kl: float, num_samples: int, horizon: int) -> float:
    """One step of the proportional KL controller of arXiv 1909.08593 (seed 000's `target_kl`).

    error = clip(kl / target - 1, -0.2, 0.2); beta <- beta * (1 + error * num_samples / horizon).
    """
    error = min(max(kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * num_samples / horizon)
