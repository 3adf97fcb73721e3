"""Which tokens the policy term learns from, and with what weight, besides the completion mask.

- Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, its eq. 9): a sequence with a
  negative advantage whose tokens' mean log(pi_sampler / pi) exceeds `off_policy_mask_threshold`
  leaves the loss: the policy has already moved away from it, and pushing it further down is
  where off-policy updates do harm. The sampler's log-probs are used where the rollout recorded
  them (our decoder and vLLM do; under top_k / top_p / min_p put on pi_old's support,
  `sampler_correction.on_policy_support`), so both the policy's drift and the sampler's mismatch
  count; otherwise pi_old.
- High-entropy token masking ("Beyond the 80/20 rule", arXiv 2506.01939): only the tokens at or
  above the (1 - top_entropy_quantile) quantile of entropy, over the loss tokens of the
  micro-batch on every process, keep their policy term (and the entropy bonus acts on them alone).
  Tokens out of the loss (truncated completions with mask_truncated_completions, tool results)
  take no part in the quantile.
- The sampler's importance weights (`sampler_correction`).
"""

import math
from collections.abc import Callable

import torch

from grpo_hf.algorithm.loss import LossSettings
from grpo_hf.algorithm.sampler_correction import sampler_is_weights

Gather = Callable[[torch.Tensor], torch.Tensor]


def get_off_policy_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    off_policy_threshold: float,
) -> torch.Tensor:
    """(B, 1) in `mask`'s dtype, as TRL's: 1 keeps a sequence, 0 drops it (A < 0 and
    mean_t(log pi_sampler - log pi) > threshold).

    advantages (B,) or (B, 1); the rest (B, T). A NaN sampler log-prob counts as no divergence.
    """
    divergence = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)  # (B, T)
    mean = (divergence * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    keep = (advantages.view(-1, 1) >= 0) | (mean <= off_policy_threshold)  # (B, 1)
    return keep.to(mask.dtype)


def get_high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, threshold: float, gather: Gather | None = None
) -> torch.Tensor:
    """(B, T) bool: loss tokens whose entropy is at least the `threshold` quantile of all loss tokens.

    The quantile (linear interpolation, as `torch.quantile`, without its size limit) is taken over
    `gather(values)`, every process's loss-token entropies (`gather_ragged`), or the local ones.
    threshold 0 keeps every token, 1 only the highest; no loss token anywhere: all False.
    """
    active = mask.bool()  # (B, T)
    values = entropies.detach()[active].float()  # (N,)
    if gather is not None:
        values = gather(values)  # (N over processes,)
    if values.numel() == 0:
        return torch.zeros_like(active)
    ordered = values.sort().values  # (N,)
    position = threshold * (ordered.numel() - 1)
    low = math.floor(position)
    high = min(low + 1, ordered.numel() - 1)
    cut = ordered[low] + (position - low) * (ordered[high] - ordered[low])
    return (entropies.detach() >= cut) & active


def gather_ragged(accelerator, values: torch.Tensor) -> torch.Tensor:
    """Every process's 1-D `values`, whatever their lengths, concatenated in process order."""
    if accelerator.num_processes == 1:
        return values
    lengths = accelerator.gather(torch.tensor([values.numel()], device=values.device)).tolist()  # (P,)
    padded = accelerator.gather(accelerator.pad_across_processes(values, dim=0)).view(len(lengths), -1)
    return torch.cat([row[:n] for row, n in zip(padded, lengths, strict=True)])


def policy_weights(
    settings: LossSettings,
    logps: torch.Tensor,
    entropy: torch.Tensor,
    old_logps: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    gather: Gather | None = None,
) -> dict[str, torch.Tensor | None]:
    """`grpo_loss`'s off_policy_mask, entropy_mask and sampler_weights for one micro-batch, as the
    run's `settings` ask, each None when off; and its entropy_normalizer.

    The sampler weights need the rollout's `sampler_logps` (absent for completions a subclass
    makes without them). The entropy bonus divides by the DAPO normaliser, so it is the token mean
    over the optimizer step on every process; with the high-entropy mask, by the kept tokens of
    this micro-step on every process (the pool the quantile is taken over), per process.
    """
    mask, sampler_logps = inputs["completion_mask"], inputs.get("sampler_logps")  # (B, T) each
    weights: dict[str, torch.Tensor | None] = {
        "off_policy_mask": None,
        "entropy_mask": None,
        "sampler_weights": None,
        "entropy_normalizer": inputs.get("dapo_normalizer"),
    }
    if settings.off_policy_mask_threshold is not None:
        weights["off_policy_mask"] = get_off_policy_mask(
            inputs["advantages"],
            logps,
            old_logps if sampler_logps is None else sampler_logps,
            mask,
            settings.off_policy_mask_threshold,
        )
    if settings.top_entropy_quantile < 1.0:
        kept = get_high_entropy_mask(entropy, mask, 1.0 - settings.top_entropy_quantile, gather)  # (B, T)
        counts = kept.sum().reshape(1).float()  # (1,)
        counts = counts if gather is None else gather(counts)  # (P,) every process's
        weights["entropy_mask"], weights["entropy_normalizer"] = kept, counts.sum() / counts.numel()
    if settings.sampler_correction is not None and sampler_logps is not None:
        weights["sampler_weights"] = sampler_is_weights(
            old_logps, sampler_logps, mask, settings.sampler_correction
        )
    return weights
