"""The GRPO objective as pure tensor functions of per-token log-probs.

Per completion token t of sequence i, with advantage A_i and ratio r = exp(logp - old_logp):

    loss_t = m_t * w_t * policy_t + beta * r_t^c * KL_t,    loss = aggregate(loss_t) - entropy_coef * H

- policy_t is the loss type's policy term (`policy_terms`): PPO's clipped surrogate
  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) for grpo / bnpo / dr_grpo / dapo / luspo, or
  CISPO's, SAPO's, VESPO's. Clip-higher `epsilon_high` from DAPO (arXiv 2503.14476); `delta` caps
  the unclipped ratio from above (two-sided clipping, INTELLECT-2, arXiv 2505.07291).
- `importance_sampling_level="sequence"` uses one ratio per sequence,
  exp(mean_t(logp - old_logp)) (GSPO, arXiv 2507.18071); gradients still reach every token.
- m_t: the off-policy sequence mask and the high-entropy token mask (`masks`); w_t: the
  importance weights against the sampler (`sampler_correction`). They act on the policy term only.
- KL_t estimates KL(pi || pi_ref) from samples of pi with x = ref_logp - logp (Schulman, "Approximating
  KL divergence", 2020, as in DeepSeekMath arXiv 2402.03300): k1 = -x, k2 = x^2 / 2,
  k3 = exp(x) - x - 1 (unbiased and never negative; the default). With
  `use_bias_correction_kl` (c = 1, the default) it is weighted by the ratio r, differentiable: the
  samples come from pi_old, and r * KL_t is the importance-sampled estimate whose gradient is the
  unbiased gradient of KL(pi || pi_ref) (DeepSeek-V3.2, arXiv 2512.02556). Even at r = 1 this
  changes the gradient: for k3 it is logp - ref_logp (k1's value) instead of 1 - exp(x).
- The entropy bonus (arXiv 2504.20571) is `entropy_coef` times the mean token entropy H over the
  tokens it acts on (the loss tokens, or those the high-entropy mask keeps), the same for every
  loss type: not scaled by the loss type's normaliser (as TRL). Its denominator is
  `entropy_normalizer`: by default the micro-batch's own count (TRL's), while the trainer passes
  the count over the whole optimizer step and every process (`masks.policy_weights`), so the
  gradient does not depend on how the step is split into micro-batches and processes.

Aggregation over tokens (`POLICY_TERMS[loss_type].aggregation`):
- `grpo`, `sapo`: mean over each sequence's tokens, then mean over sequences (DeepSeekMath).
- `bnpo`: mean over the micro-batch's active tokens.
- `dr_grpo`: sum / (B * max_completion_length), a constant normaliser (Dr. GRPO, arXiv 2503.20783).
- `luspo`: sum over each sequence's tokens, then mean over sequences: each sequence weighs by its
  length (LUSPO, arXiv 2602.05261).
- `dapo`, `cispo`, `vespo`: sum / active tokens of everything that feeds the same optimizer step
  (DAPO's token-level mean: every micro-batch of that step, on every process). The caller passes
  that count, scaled for gradient accumulation and processes, as `dapo_normalizer`
  (`dapo_normalizers`); without it the micro-batch's own count is used, which is
  exact when one micro-batch is the step.
  With no active token at all the loss is 0 (so are its gradients), not NaN; likewise for the others.

With one pass over each generation round (num_iterations = 1, one optimizer step per round),
old_logp is the current log-prob detached: the ratio is exactly 1, the clip never binds, and the
loss value is -mean(A) + beta * KL (about 0 with normalised advantages) while the gradient is the
policy gradient A * grad log pi. A logged loss near 0 is therefore expected, not a bug.
"""

from dataclasses import dataclass

import torch

from grpo_hf.algorithm.policy_terms import POLICY_TERMS, Metrics, PolicySettings, masked_mean
from grpo_hf.algorithm.sampler_correction import SamplerCorrection, Truncation


@dataclass(frozen=True)
class LossSettings:
    """What the loss takes of a run's settings, under `GRPOConfig`'s names; `GRPOConfig.loss_settings()`
    builds it once (the defaults are the config's, declared there only)."""

    loss_type: str
    policy: PolicySettings  # the policy term's knobs
    kl_estimator: str
    use_bias_correction_kl: bool
    importance_sampling_level: str
    max_completion_length: int | None  # dr_grpo's constant; None: the tensors' width
    off_policy_mask_threshold: float | None  # `masks.get_off_policy_mask`; None: off
    top_entropy_quantile: float  # `masks.get_high_entropy_mask`; 1.0: off
    sampler_correction: SamplerCorrection | None  # importance sampling against the sampler; None: off
    sampler_truncation: Truncation | None  # the sampler's, replayed for its support; None: whole vocabulary


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


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int,
    dapo_normalizer: float | torch.Tensor | None = None,
    batch_rows: int | None = None,
    batch_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar as `loss_type` does (see the module docstring).

    `batch_rows` / `batch_tokens`: the rows and loss tokens of the micro-batch these B rows are a
    pass of (`token_budget`), which the per-micro-batch means divide by; by default these rows'.
    The passes' losses then add up to the micro-batch's.
    """
    if loss_type not in POLICY_TERMS:
        raise ValueError(f"loss_type={loss_type!r} is not one of {tuple(POLICY_TERMS)}.")
    how = POLICY_TERMS[loss_type].aggregation
    masked = per_token * mask  # (B, T)
    rows = per_token.shape[0] if batch_rows is None else batch_rows
    tokens = mask.sum() if batch_tokens is None else batch_tokens
    if how == "sequence_mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / rows
    if how == "sequence_sum":
        return masked.sum(dim=1).sum() / rows
    if how == "batch_token_mean":
        return masked.sum() / tokens.clamp(min=1)
    if how == "constant":
        return masked.sum() / (rows * max_completion_length)
    return token_mean(per_token, mask, tokens if dapo_normalizer is None else dapo_normalizer)


def token_mean(
    values: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None = None
) -> torch.Tensor:
    """sum(values * mask) / normalizer, by default mask's own count; 0 when the count is 0."""
    total = (values * mask).sum()
    count = torch.as_tensor(
        mask.sum() if normalizer is None else normalizer, dtype=total.dtype, device=total.device
    )
    # No active token at all (e.g. every completion truncated and masked): 0, not 0 / 0.
    return total / torch.where(count > 0, count, torch.ones_like(count))


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: LossSettings,
    *,
    beta: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    dapo_normalizer: float | torch.Tensor | None = None,
    entropy_normalizer: float | torch.Tensor | None = None,
    sampler_weights: torch.Tensor | None = None,
    off_policy_mask: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    batch_rows: int | None = None,
    batch_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The GRPO loss of one micro-batch and its metrics (detached scalars).

    logps, old_logps, ref_logps, entropy, completion_mask: (B, T) over completion tokens;
    advantages: (B,). `old_logps=None` means "same policy": logps detached. `ref_logps` may be
    None only when beta = 0 (no KL term; `beta` and `entropy_coef`, 0 for off, are the current
    values of settings that may adapt during training). Without gradient:
    `sampler_weights` (B, T), the importance weights pi_old / pi_sampler
    (`sampler_correction.sampler_is_weights`); `off_policy_mask` (B, 1) (`masks.get_off_policy_mask`);
    `entropy_mask` (B, T) (`masks.get_high_entropy_mask`), which also restricts the entropy bonus.
    `dapo_normalizer` / `entropy_normalizer`: the token counts the dapo-style sum and the entropy
    bonus divide by; by default this micro-batch's (see the module docstring). `batch_rows` /
    `batch_tokens`: where these rows are one pass of a micro-batch, its rows and loss tokens
    (`aggregate`); the entropy bonus then needs `entropy_normalizer`.
    Metrics are means over the active tokens, except `policy_loss` (the loss before the entropy
    bonus) and the extremes `clip_ratio/low_min` and `clip_ratio/high_max`.
    """
    loss_type = settings.loss_type
    if loss_type not in POLICY_TERMS:
        raise ValueError(f"loss_type={loss_type!r} is not one of {tuple(POLICY_TERMS)}.")
    term = POLICY_TERMS[loss_type]
    width = logps.shape[1] if settings.max_completion_length is None else settings.max_completion_length
    mask = completion_mask.to(logps.dtype)  # (B, T)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = importance_log_ratio(logps, old_logps, mask, settings.importance_sampling_level)  # (B, T)
    per_token, metrics = term.per_token(
        logps, old_logps, log_ratio, advantages.unsqueeze(1), mask, settings.policy, sampler_weights
    )  # (B, T)
    for factor in (off_policy_mask, entropy_mask, None if term.takes_sampler_weights else sampler_weights):
        if factor is not None:
            per_token = per_token * factor
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps.")
        kl = kl_estimate(logps, ref_logps, settings.kl_estimator)  # (B, T)
        if settings.use_bias_correction_kl:
            kl = kl * torch.exp(log_ratio)  # samples from pi_old: importance-weighted, with gradient
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, loss_type, width, dapo_normalizer, batch_rows, batch_tokens)
    metrics["policy_loss"] = loss.detach()
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if entropy_coef != 0.0:
            bonus_tokens = mask if entropy_mask is None else mask * entropy_mask  # (B, T)
            loss = loss - entropy_coef * token_mean(entropy, bonus_tokens, entropy_normalizer)
    return loss, metrics


def adaptive_beta(beta: float, kl: float, target_kl: float, num_samples: int, horizon: int) -> float:
    """One step of the proportional KL controller of arXiv 1909.08593 (seed 000's `target_kl`).

    error = clip(kl / target - 1, -0.2, 0.2); beta <- beta * (1 + error * num_samples / horizon).
    """
    error = min(max(kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * num_samples / horizon)


def dapo_normalizers(token_counts: torch.Tensor, per_step: int) -> list[torch.Tensor]:
    """Per micro-batch: the DAPO denominator that makes each optimizer step a token mean.

    `token_counts` (P, S): the active tokens of each process's S micro-batches of a round, of which
    `per_step` in a row feed one optimizer step. The Trainer divides each micro-step's loss by
    gradient_accumulation_steps and DDP averages over processes, so a micro-batch feeding an
    optimizer step with n active tokens (summed over that step's micro-batches and every process)
    divides its token sum by n / (P * GA). With several optimizer steps per round
    (steps_per_generation = k * GA) each step has its own n; with several rounds per step (GA a
    multiple of steps_per_generation, `per_step` = S) n is the round's, and the step's gradient is
    the mean of its rounds' token means. No other pair is accepted (steps would straddle rounds;
    `config.rollout_args.check_steps_fit_rounds`). In evaluation (one part per process, `per_step` = 1) n / P
    makes the mean of the processes' losses the global token mean.
    """
    processes, parts = token_counts.shape
    counts = token_counts.sum(dim=0)  # (S,) over processes
    totals = counts.view(-1, per_step).sum(dim=1)  # (S / per_step,) active tokens per optimizer step
    return [totals[i // per_step] / (processes * per_step) for i in range(parts)]
