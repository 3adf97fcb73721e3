"""The policy term of each loss type: a per-token loss from log-probs, ratios and advantages.

Every term takes the current log-probs `logps`, the old ones `old_logps`, the importance log-ratio
`log_ratio` = log(pi / pi_old) per token, or its per-sequence mean broadcast over the tokens (GSPO,
`importance_sampling_level="sequence"`), and the advantages (B, 1); it returns the (B, T) policy
loss before masks, sampler weights, KL and aggregation (`loss.grpo_loss` adds those), and its
metrics: means over the active tokens, and the clip's extremes over sequences.

- clip (`grpo`, `bnpo`, `dr_grpo`, `dapo`, `luspo`): -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
  with r capped at `delta` (two-sided clip, INTELLECT-2 arXiv 2505.07291).
- `cispo` (MiniMax-M1, arXiv 2506.13585): -sg(min(r, epsilon_high)) A log pi. The weight, not the
  update, is clipped, so every token keeps a gradient; `epsilon_high` is the cap on r itself
  (ScaleRL, arXiv 2510.13786, uses 4 to 5), not 1 + epsilon_high.
- `sapo` (arXiv 2511.20347): -(4 / tau) sigmoid(tau (r - 1)) A, a soft gate whose gradient is A at
  r = 1 and fades smoothly away from it; tau = sapo_temperature_pos for A > 0, _neg otherwise.
- `vespo` (arXiv 2602.10693): -sg(phi(w)) A log pi with w the sequence's ratio prod_t r_t (times
  the sampler's importance weights, which VESPO takes in here rather than as a factor) and the
  Gamma-shaped phi(w) = e^lambda w^k e^(-lambda w), so phi(1) = 1; (k, lambda) = vespo_k_pos,
  vespo_lambda_pos for A >= 0, the _neg ones otherwise. Computed in log space with log r_t and
  log w clamped as the paper's code does.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

Metrics = dict[str, torch.Tensor]
LOG_1E8 = math.log(1e-8)  # VESPO's floor on log w (and on a sampler weight's log)


@dataclass(frozen=True)
class PolicySettings:
    """The knobs of the policy terms, under `GRPOConfig`'s names (its defaults; epsilon_high resolved)."""

    epsilon: float
    epsilon_high: float
    delta: float | None
    sapo_temperature_neg: float
    sapo_temperature_pos: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; 0 for an empty mask."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """Per-token min(r * A, clip(r) * A) with r = exp(log_ratio); advantages (B,) broadcast over T."""
    ratio = torch.exp(log_ratio)  # (B, T)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)  # (B, T)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    adv = advantages.unsqueeze(1)  # (B, 1)
    return torch.min(ratio * adv, clipped * adv)  # (B, T)


def clip_term(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: PolicySettings,
    sampler_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate, negated; metrics: how often the clip binds."""
    per_token = -clipped_surrogate(log_ratio, advantages.squeeze(1), s.epsilon, s.epsilon_high, s.delta)
    return per_token, clip_metrics(log_ratio.detach(), advantages, mask, s.epsilon, s.epsilon_high)


def clip_metrics(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float, epsilon_high: float
) -> Metrics:
    """Fractions of active tokens where the clip binds: below (A < 0) and above (A > 0).

    Under our names (`clip_ratio/low` ...) and TRL's (`clip_ratio/low_mean` ...), the same token
    means; TRL's `clip_ratio/low_min` / `high_max` are the least / most clipped sequence's fraction.
    """
    ratio = torch.exp(log_ratio)  # (B, T)
    low = ((ratio < 1 - epsilon) & (advantages < 0)).to(mask.dtype)  # (B, T)
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype)  # (B, T)
    means = {"low": masked_mean(low, mask), "high": masked_mean(high, mask)}
    means["region"] = masked_mean(low + high, mask)
    tokens = mask.sum(dim=1)  # (B,)
    active = tokens > 0  # (B,) sequences with a token in the loss
    low_seq = (low * mask).sum(dim=1) / tokens.clamp(min=1)  # (B,)
    high_seq = (high * mask).sum(dim=1) / tokens.clamp(min=1)  # (B,)
    return {
        **{f"clip_ratio/{name}": value for name, value in means.items()},
        **{f"clip_ratio/{name}_mean": value for name, value in means.items()},
        "clip_ratio/low_min": low_seq.masked_fill(~active, math.inf).min(),  # inf: no sequence
        "clip_ratio/high_max": high_seq.masked_fill(~active, -math.inf).max(),
    }


def cispo_term(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: PolicySettings,
    sampler_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: the importance weight clipped at epsilon_high, detached, times -A log pi."""
    ratio = torch.exp(log_ratio.detach())  # (B, T)
    per_token = -ratio.clamp(max=s.epsilon_high) * advantages * logps  # (B, T)
    clipped = ((ratio > s.epsilon_high) & (advantages > 0)).to(mask.dtype)  # (B, T)
    return per_token, {"cispo_clip_ratio": masked_mean(clipped, mask)}


def sapo_term(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: PolicySettings,
    sampler_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the advantage's sign (A > 0: _pos)."""
    tau = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)  # (B, 1)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1)) * 4 / tau  # (B, T)
    return -gate * advantages, {}


@torch.no_grad()
def get_gamma_weights(
    advantages: torch.Tensor,
    log_ratio_per_token: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's (B, 1) weights phi(w) = exp(lambda + k log w - lambda w), without gradient.

    advantages (B, 1); log_ratio_per_token (B, T) = log(pi / pi_old), each clamped to [-20, 20]
    and summed over the active tokens into log w; `importance_sampling_ratio` (B, T), the
    sampler's token weights pi_old / pi_sampler, adds its clamped logs; log w is clamped to
    [log 1e-8, 20]. A non-finite phi becomes 0.
    """
    log_w = (log_ratio_per_token.clamp(-20.0, 20.0) * mask).sum(dim=1, keepdim=True)  # (B, 1)
    if importance_sampling_ratio is not None:
        log_is = importance_sampling_ratio.log().clamp(LOG_1E8, 20.0)  # (B, T); a masked-out weight 0 -> 1e-8
        log_w = log_w + (log_is * mask).sum(dim=1, keepdim=True)
    log_w = log_w.clamp(LOG_1E8, 20.0)  # (B, 1)
    nonneg = advantages >= 0  # (B, 1)
    k = torch.where(nonneg, k_pos, k_neg)  # (B, 1)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)  # (B, 1)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)  # (B, 1)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # (B, 1)


def vespo_term(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: PolicySettings,
    sampler_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    """VESPO: -phi(w) A log pi with phi from the token ratios (any importance_sampling_level)."""
    phi = get_gamma_weights(
        advantages,
        logps - old_logps,
        mask,
        sampler_weights,
        s.vespo_k_pos,
        s.vespo_lambda_pos,
        s.vespo_k_neg,
        s.vespo_lambda_neg,
    )  # (B, 1)
    return -phi * advantages * logps, {"vespo/phi_seq_mean": masked_mean(phi.expand_as(mask), mask)}


class PolicyTerm(NamedTuple):
    """A loss type's policy term and how its per-token values are reduced to the loss."""

    per_token: Callable[..., tuple[torch.Tensor, Metrics]]
    aggregation: str  # see `loss.aggregate`
    takes_sampler_weights: bool  # uses the sampler's importance weights itself, not as a factor


POLICY_TERMS: dict[str, PolicyTerm] = {
    "grpo": PolicyTerm(clip_term, "sequence_mean", False),
    "bnpo": PolicyTerm(clip_term, "batch_token_mean", False),
    "dr_grpo": PolicyTerm(clip_term, "constant", False),
    "dapo": PolicyTerm(clip_term, "global_token_mean", False),
    "luspo": PolicyTerm(clip_term, "sequence_sum", False),
    "cispo": PolicyTerm(cispo_term, "global_token_mean", False),
    "sapo": PolicyTerm(sapo_term, "sequence_mean", False),
    "vespo": PolicyTerm(vespo_term, "global_token_mean", True),
}
# The loss types whose policy term is the clipped surrogate: the ones epsilon (below) and delta act on.
CLIPPED_LOSS_TYPES = tuple(name for name, term in POLICY_TERMS.items() if term.per_token is clip_term)
