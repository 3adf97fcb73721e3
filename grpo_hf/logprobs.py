"""Per-token log-probs (and entropy) of completion tokens, without materialising more than needed.

Only the completion positions go through the LM head (`logits_to_keep`), and the log-softmax is
taken one sequence at a time in float32, so the full (B, T, V) float32 tensor never exists for a
bf16 model. Logits are divided by the sampling temperature, so log-probs are those of the
distribution the completions were sampled from.
"""

import torch
from torch import nn


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions that skip left padding, as `generate` computes them."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)


def completion_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int
) -> torch.Tensor:
    """(B, C, V) logits predicting each of the last C tokens of input_ids."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=completion_length + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]  # (B, C, V): the last position predicts beyond the sequence


def token_logps_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) (B, C) and optionally the token entropy (B, C), one row at a time in float32.

    The entropy carries gradients only with `entropy_grad` (an entropy bonus); as a metric it
    would otherwise keep a (C, V) softmax per row alive until backward.
    """
    logps, entropies = [], []
    for row_logits, row_targets in zip(logits, targets, strict=True):
        scaled = row_logits.float() / temperature  # (C, V)
        log_norm = torch.logsumexp(scaled, dim=-1)  # (C,)
        logps.append(scaled.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1) - log_norm)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs = torch.softmax(scaled, dim=-1)  # (C, V)
                entropies.append(log_norm - (probs * scaled).sum(dim=-1))
    entropy = torch.stack(entropies) if with_entropy else None
    return torch.stack(logps), entropy  # (B, C), (B, C) | None


def completion_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of the last C tokens of input_ids under `model`, and their entropy if asked."""
    logits = completion_logits(model, input_ids, attention_mask, completion_length)  # (B, C, V)
    targets = input_ids[:, -completion_length:]  # (B, C)
    return token_logps_and_entropy(logits, targets, temperature, with_entropy, entropy_grad)
