"""Padding-free loss passes: the prompts and completions of a batch as one row of real tokens.

A GRPO batch holds each prompt G times, left-padded to the longest prompt, and completions
right-padded to the longest completion; every padding position after an EOS and every repeated
prompt would cost a full forward and backward through every linear layer. Here each distinct
prompt's real tokens and then every row's real completion tokens are laid end to end in one row,
each token with its own position id, and the model runs once on it. Every layer but attention
works token by token, so on that row it computes exactly what it would on the padded batch. For
attention the model's attention implementation is swapped, for this one call, for
`packed_attention`: it scatters queries, keys and values back into padded layouts, lets each
prompt attend causally to itself and each completion to its prompt's keys and its own earlier
tokens, and gathers the real positions again. Attention is a small part of the cost at these
lengths; the MLPs, projections and LM head see only real tokens, each prompt once.

It applies to model types whose attention goes through transformers' attention interface with
nothing that depends on the layout (no sliding window, no soft-capping): `PACKABLE_MODEL_TYPES`.
A forward in which `packed_attention` was never called raises instead of silently attending
across rows.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from grpo_hf.engine.attention import bias_from, causal_allowed, grouped_attention

PACKED_ATTENTION = "grpo_hf_packed"
PACKABLE_MODEL_TYPES = frozenset({"llama", "gpt2"})


class Padded:
    """A padded (R, W) layout and the positions of its real entries, in row-major order."""

    def __init__(self, real: torch.Tensor):
        self.shape = real.shape  # (R, W)
        self.flat_index = real.flatten().nonzero().squeeze(1)  # (n,): row * W + column
        self.count = self.flat_index.shape[0]

    def pad(self, states: torch.Tensor) -> torch.Tensor:
        """(1, H, n, d) packed states -> (R, H, W, d), zeros at padding."""
        rows, width = self.shape
        _, heads, _, dim = states.shape
        flat = states.new_zeros(rows * width, heads, dim).index_copy(
            0, self.flat_index, states.squeeze(0).transpose(0, 1)
        )
        return flat.view(rows, width, heads, dim).transpose(1, 2)

    def unpad(self, states: torch.Tensor) -> torch.Tensor:
        """(R, H, W, d) -> (1, n, H, d), the layout attention implementations return."""
        rows, heads, width, dim = states.shape
        flat = states.transpose(1, 2).reshape(rows * width, heads, dim)
        return flat.index_select(0, self.flat_index).unsqueeze(0)


class PackedRows:
    """The packed row: U distinct prompts' real tokens, then the real tokens of B completions.

    `prompt_real` (U, P) marks each distinct prompt's real tokens, `row_to_unique` (B,) each
    completion's prompt, `completion_real` (B, C) its real tokens. A plain class, not a dataclass:
    DDP copies dataclass arguments when it moves inputs, and the call count must reach the caller.
    """

    def __init__(self, prompt_real: torch.Tensor, row_to_unique: torch.Tensor, completion_real: torch.Tensor):
        self.prompts, self.completions = Padded(prompt_real), Padded(completion_real)
        self.row_to_unique = row_to_unique  # (B,)
        self.prompt_bias = bias_from(causal_allowed(prompt_real))  # (U, 1, P, P)
        rows, width = completion_real.shape
        own_prompt = prompt_real[row_to_unique][:, None, :].expand(rows, width, -1)  # (B, C, P)
        # (B, 1, C, P + C): the row's prompt, then its own earlier tokens
        self.completion_bias = bias_from(torch.cat([own_prompt, causal_allowed(completion_real)], dim=-1))
        self.calls = 0


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
    """Attention over a packed row (1, H, n, d): prompts causally, completions over prompt and past."""
    if packed_rows is None:
        raise RuntimeError(f"attention implementation {PACKED_ATTENTION!r} needs packed_rows")
    packed_rows.calls += 1
    prompts, completions, split = packed_rows.prompts, packed_rows.completions, packed_rows.prompts.count
    prompt_q, prompt_k, prompt_v = (prompts.pad(x[:, :, :split]) for x in (query, key, value))  # (U, ., P, d)
    prompt_out = grouped_attention(prompt_q, prompt_k, prompt_v, packed_rows.prompt_bias, scaling, dropout)
    index = packed_rows.row_to_unique
    completion_out = grouped_attention(  # (B, H, C, d)
        completions.pad(query[:, :, split:]),
        torch.cat(
            [prompt_k.index_select(0, index), completions.pad(key[:, :, split:])], dim=2
        ),  # (B, Hkv, P + C, d)
        torch.cat([prompt_v.index_select(0, index), completions.pad(value[:, :, split:])], dim=2),
        packed_rows.completion_bias,
        scaling,
        dropout,
    )
    out = torch.cat([prompts.unpad(prompt_out), completions.unpad(completion_out)], dim=1)  # (1, n, H, d)
    return out, None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP / DeepSpeed wrappers (a PEFT model stays as it is)."""
    while isinstance(getattr(model, "module", None), nn.Module):  # DDP and DeepSpeed engines
        model = model.module
    return model


def model_config(model: nn.Module) -> PretrainedConfig | None:
    """The transformers config of `model`, looking through DDP / DeepSpeed wrappers."""
    config = getattr(unwrapped(model), "config", None)
    return config if isinstance(config, PretrainedConfig) else None


def can_pack(model: nn.Module) -> bool:
    """Whether `packed_forward` computes exactly what a padded forward of this model would."""
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


@contextlib.contextmanager
def output_head(model: nn.Module, head: nn.Module | None) -> Iterator[None]:
    """Run the model with `head` in place of its LM head (if not None), restoring it afterwards."""
    if head is None:
        yield
        return
    inner = unwrapped(model)
    previous = inner.get_output_embeddings()
    inner.set_output_embeddings(head)
    try:
        yield
    finally:
        inner.set_output_embeddings(previous)


def packed_forward(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keep: torch.Tensor,
    rows: PackedRows,
    head: nn.Module | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The LM head's output (K, V logits) at packed positions `keep` of the row `tokens` (n,) at `positions` (n,).

    `head`, if given, stands in for the model's LM head during the call (inside the model's
    forward, so under its autocast and its DDP hooks), on the (1, K, E) hidden states.
    """
    with attention_implementation(model_config(model), PACKED_ATTENTION), output_head(model, head):
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
    if head is not None:
        return out.logits
    return out.logits.squeeze(0)  # (K, V); a view (indexing [0] would copy the whole gradient back)
