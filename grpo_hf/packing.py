"""Padding-free completion pass: only the real completion tokens go through the model's layers.

Completions in a GRPO batch are right-padded to the longest one, and each padding position after
an EOS costs a full forward and backward through every linear layer and the LM head. Here the real
completion tokens of all rows are laid end to end in one row of N tokens, with each token's own
position id. Every layer but attention works token by token, so on that row they compute exactly
what they would on the padded batch. For attention the model's attention implementation is
swapped, for this one call, for `packed_attention`: it scatters queries, keys and values back into
the padded (B, H, C, d) layout, lets each row attend to its prompt's keys (from the prompt
prefill's cache) and to its own earlier completion tokens, and gathers the real positions again.
Attention is a small part of the cost at these lengths; the MLPs, projections and LM head see only
real tokens.

It applies to model types whose attention goes through transformers' attention interface with
nothing that depends on the layout (no sliding window, no soft-capping): `PACKABLE_MODEL_TYPES`.
A forward in which `packed_attention` was never called raises instead of silently attending
across rows.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, DynamicCache, PretrainedConfig

PACKED_ATTENTION = "grpo_hf_packed"
PACKABLE_MODEL_TYPES = frozenset({"llama", "gpt2"})


class PackedRows:
    """Where each of the N packed tokens sits in the padded (B, C) completion layout.

    A plain class, not a dataclass: DDP copies dataclass arguments when it moves inputs, and the
    call count must reach the caller.
    """

    def __init__(self, real: torch.Tensor, prompt_mask: torch.Tensor, cache: DynamicCache):
        rows, width = real.shape  # (B, C)
        self.shape = (rows, width)
        self.flat_index = real.flatten().nonzero().squeeze(1)  # (N,): row * C + column
        causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()  # (C, C)
        self.key_mask = torch.cat(  # (B, 1, C, P + C): the row's prompt, then its own earlier tokens
            [
                prompt_mask.bool()[:, None, None, :].expand(rows, 1, width, prompt_mask.shape[1]),
                (causal & real[:, None, :])[:, None],
            ],
            dim=-1,
        )
        self.cache = cache  # the prompts' keys and values, one row per completion
        self.calls = 0

    def pad(self, states: torch.Tensor) -> torch.Tensor:
        """(1, H, N, d) packed states -> (B, H, C, d), zeros at padding."""
        rows, width = self.shape
        _, heads, _, dim = states.shape
        flat = states.new_zeros(rows * width, heads, dim).index_copy(
            0, self.flat_index, states[0].transpose(0, 1)
        )
        return flat.view(rows, width, heads, dim).transpose(1, 2)

    def unpad(self, states: torch.Tensor) -> torch.Tensor:
        """(B, H, C, d) -> (1, N, H, d), the layout attention implementations return."""
        rows, heads, width, dim = states.shape
        return states.transpose(1, 2).reshape(rows * width, heads, dim)[self.flat_index].unsqueeze(0)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_rows: PackedRows | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over packed completion tokens (1, H, N, d): each row sees its prompt and its past."""
    if packed_rows is None:
        raise RuntimeError(f"attention implementation {PACKED_ATTENTION!r} needs packed_rows")
    packed_rows.calls += 1
    prompt = packed_rows.cache.layers[module.layer_idx]
    query = packed_rows.pad(query)  # (B, H, C, d)
    key = torch.cat([prompt.keys, packed_rows.pad(key)], dim=2)  # (B, Hkv, P + C, d)
    value = torch.cat([prompt.values, packed_rows.pad(value)], dim=2)  # (B, Hkv, P + C, d)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=packed_rows.key_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # (B, H, C, d)
    return packed_rows.unpad(out), None  # (1, N, H, d)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def model_config(model: nn.Module) -> PretrainedConfig | None:
    """The transformers config of `model`, looking through DDP / DeepSpeed wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module):  # DDP and DeepSpeed engines
        model = model.module
    config = getattr(model, "config", None)
    return config if isinstance(config, PretrainedConfig) else None


def can_pack(model: nn.Module) -> bool:
    """Whether `packed_logits` computes exactly what a padded forward of this model would."""
    config = model_config(model)
    return (
        config is not None
        and config.model_type in PACKABLE_MODEL_TYPES
        and getattr(config, "sliding_window", None) is None
    )


@contextlib.contextmanager
def attention_implementation(config: PretrainedConfig, name: str) -> Iterator[None]:
    """Run the model's attention layers with implementation `name`, restoring it afterwards."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def packed_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keep: torch.Tensor,
    rows: PackedRows,
) -> torch.Tensor:
    """(K, V) logits at packed positions `keep` of the packed row `tokens` (N,) at `positions` (N,)."""
    with attention_implementation(model_config(model), PACKED_ATTENTION):
        out = model(
            input_ids=tokens.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=keep,
            packed_rows=rows,
        )
    if rows.calls == 0:
        raise RuntimeError(
            f"{type(model).__name__} did not route attention through transformers' attention interface; "
            "packed completion passes cannot be used with it."
        )
    return out.logits[0]  # (K, V)
