"""Attention with grouped query heads, for the short sequences of GRPO on a CPU.

Used by the padding-free loss passes (`packing`) and by both decoding paths (`decoding`,
`generation_copy`). The query heads that share a key head are stacked into one matrix, so each key
and value head is multiplied as it is, without the per-query-head copies SDPA's math kernel makes
for grouped-query attention, and without that kernel's mask conversions and checks
(`bench/levers.py` times a padding-free loss pass with each). Without autocast (decoding) scores,
softmax and the weighted sum are float32 whatever the input dtype, so bf16 weights still attend in
float32. Under autocast (the loss passes of a bf16 run) `bmm` runs in the autocast dtype whatever
its inputs, as in transformers' own attention, so the inputs are not upcast only to be cast back.
"""

import torch
import torch.nn.functional as F


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, each key head shared by its group of query heads.

    query (R, H, W, d); key, value (R, Hkv, L, d) with H a multiple of Hkv (head h uses key head
    h // (H / Hkv), as transformers' `repeat_kv`); bias broadcastable to (R, 1, W, L), 0 where a
    query may attend and -inf where not. Returns (R, H, W, d) in the query's dtype.
    """
    rows, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    dtype = query.dtype if torch.is_autocast_enabled(query.device.type) else torch.float32
    grouped = query.reshape(rows * kv_heads, group * width, dim).to(dtype)  # (R * Hkv, G * W, d)
    keys = key.to(dtype).reshape(rows * kv_heads, length, dim).transpose(1, 2)  # (R * Hkv, d, L)
    scale = dim**-0.5 if scale is None else scale
    scores = torch.bmm(grouped, keys).mul_(scale)  # (R * Hkv, G * W, L)
    if bias is not None:  # (R, 1, 1, W, L) broadcasts over key heads and groups; 0 and -inf are exact
        scores.view(rows, kv_heads, group, width, length).add_(bias.to(scores.dtype).unsqueeze(2))
    probs = scores.softmax(dim=-1)  # (R * Hkv, G * W, L)
    if dropout:
        probs = F.dropout(probs, dropout)
    values = value.to(dtype).reshape(rows * kv_heads, length, dim)
    return torch.bmm(probs, values).view(rows, heads, width, dim).to(query.dtype)  # (R, H, W, d)


def causal_allowed(real: torch.Tensor) -> torch.Tensor:
    """(R, W, W) bool: query i sees real keys j <= i; padding queries see themselves (no empty row)."""
    width = real.shape[1]
    lower = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()  # (W, W)
    return (lower & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=real.device)


def bias_from(allowed: torch.Tensor) -> torch.Tensor:
    """(R, W, L) bool -> (R, 1, W, L) float32 attention bias: 0 where allowed, -inf elsewhere."""
    bias = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return bias.unsqueeze(1)
