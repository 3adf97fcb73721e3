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
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from grpo_hf.engine.attention import bias_from, causal_allowed, grouped_attention

PACKED_ATTENTION = "grpo_hf_packed"
PACKABLE_MODEL_TYPES = frozenset({"llama", "gpt2"})
# Most attention scores per head (rows x completion width x (prompt + completion width)) that
# `grouped_attention` takes in a loss pass on a CPU; see `uses_causal_rows`. Set at the
# benchmark's shape (16 rows of 48 new tokens after ~30 prompt tokens), whose speed it keeps.
GROUPED_MAX_SCORES = 16 * 48 * 78


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


class CausalRows:
    """Each completion as one causal row: its prompt's real tokens, its own real tokens, then padding.

    In this layout "each completion sees its prompt and its own earlier tokens" is plain causal
    attention, so SDPA runs with `is_causal=True` and no mask: its CPU flash kernel (and CUDA's
    flash / memory-efficient ones) keep q, k, v, the output and a logsumexp per query for backward,
    nothing of size length^2. A prompt's queries are attended once per completion (the projections
    and MLPs still see each prompt once); each prompt token's output is taken from the first row of
    its prompt, so the other copies get no gradient. Padding sits at the end of a row and is read
    from packed token 0: no real query sees it.
    """

    def __init__(self, prompt_real: torch.Tensor, row_to_unique: torch.Tensor, completion_real: torch.Tensor):
        prompt_lengths, completion_lengths = prompt_real.sum(dim=1), completion_real.sum(dim=1)  # (U,), (B,)
        prompt_starts = prompt_lengths.cumsum(dim=0) - prompt_lengths  # (U,) first packed index
        completion_starts = (
            prompt_lengths.sum() + completion_lengths.cumsum(dim=0) - completion_lengths
        )  # (B,)
        own_prompt = prompt_lengths[row_to_unique][:, None]  # (B, 1)
        self.width = int((own_prompt.squeeze(1) + completion_lengths).max())
        column = torch.arange(self.width, device=prompt_real.device)[None, :]  # (1, L)
        source = torch.where(
            column < own_prompt,
            prompt_starts[row_to_unique][:, None] + column,
            completion_starts[:, None] + column - own_prompt,
        )  # (B, L) the packed token at each place of each row
        real = column < own_prompt + completion_lengths[:, None]  # (B, L)
        self.gather = torch.where(real, source, 0).flatten()  # (B * L,)
        rows = row_to_unique.shape[0]
        first_row = torch.full_like(prompt_lengths, rows).scatter_reduce_(
            0, row_to_unique, torch.arange(rows, device=row_to_unique.device), "amin"
        )  # (U,) the first completion row of each prompt
        prompt_rank = prompt_real.cumsum(dim=1) - 1  # (U, P) a real token's place in its prompt
        prompt_place = (first_row[:, None] * self.width + prompt_rank)[prompt_real]  # (prompt tokens,)
        completion_column = torch.arange(completion_real.shape[1], device=prompt_real.device)[
            None, :
        ]  # (1, C)
        row_start = torch.arange(rows, device=prompt_real.device)[:, None] * self.width + own_prompt  # (B, 1)
        completion_place = row_start + completion_column  # (B, C)
        self.scatter = torch.cat([prompt_place, completion_place[completion_real]])  # (n,) each token's place

    def rows(self, states: torch.Tensor) -> torch.Tensor:
        """(1, H, n, d) packed states -> (B, H, L, d) causal rows."""
        _, heads, _, dim = states.shape
        flat = states.squeeze(0).transpose(0, 1).index_select(0, self.gather)  # (B * L, H, d)
        return flat.view(-1, self.width, heads, dim).transpose(1, 2)

    def packed(self, states: torch.Tensor) -> torch.Tensor:
        """(B, H, L, d) -> (1, n, H, d), the layout attention implementations return."""
        rows, heads, width, dim = states.shape
        return (
            states.transpose(1, 2)
            .reshape(rows * width, heads, dim)
            .index_select(0, self.scatter)
            .unsqueeze(0)
        )


def uses_causal_rows(prompt_real: torch.Tensor, completion_real: torch.Tensor) -> bool:
    """Whether a pass takes SDPA over `CausalRows` rather than `grouped_attention` over padded blocks.

    The one place the attention of the loss passes is chosen, by the attention scores per head:
    rows x completion width x (prompt + completion width). `grouped_attention` keeps its
    probabilities, rows x heads x that, in every layer for backward; SDPA keeps nothing that size.

    Measured on one attention call, forward + backward, SmolLM2-135M's heads (9 query over 3
    key/value heads, head_dim 64), float32, torch 2.13 on 2 AVX2 cores shared with other jobs,
    medians of 5 (SDPA over causal rows against `grouped_attention` over padded blocks; bytes saved
    for backward): 4 rows x 1024 tokens 0.50 s against 2.46 s, 25 MB against 163 MB; 2 rows x 4096
    4.2 s against 26.4 s, 49 MB against 1190 MB; 16 rows x 128: 93 ms against 133 ms.
    At the benchmark's 16 rows x 48 the two runs disagreed (34 against 63 ms, 91 against 58 ms)
    on the loaded machine, so that shape keeps the attention its 3x benchmark was measured with.
    """
    scores = (
        completion_real.shape[0]
        * completion_real.shape[1]
        * sum(completion_real.shape[1:] + prompt_real.shape[1:])
    )
    return prompt_real.device.type != "cpu" or scores > GROUPED_MAX_SCORES


class PackedRows:
    """The packed row: U distinct prompts' real tokens, then the real tokens of B completions.

    `prompt_real` (U, P) marks each distinct prompt's real tokens, `row_to_unique` (B,) each
    completion's prompt, `completion_real` (B, C) its real tokens. A plain class, not a dataclass:
    DDP copies dataclass arguments when it moves inputs, and the call count must reach the caller.
    Short batches on a CPU attend in padded blocks with `grouped_attention`; others as
    `CausalRows` with SDPA (`uses_causal_rows`).
    """

    def __init__(self, prompt_real: torch.Tensor, row_to_unique: torch.Tensor, completion_real: torch.Tensor):
        self.prompts, self.completions = Padded(prompt_real), Padded(completion_real)
        self.row_to_unique = row_to_unique  # (B,)
        self.causal = None
        if uses_causal_rows(prompt_real, completion_real):
            self.causal = CausalRows(prompt_real, row_to_unique, completion_real)
        else:
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
    if packed_rows.causal is not None:
        causal = packed_rows.causal
        query, key, value = (causal.rows(x) for x in (query, key, value))  # (B, ., L, d)
        out = F.scaled_dot_product_attention(
            query,
            key.to(query.dtype),
            value.to(query.dtype),
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=True,
        )  # (B, H, L, d)
        return causal.packed(out), None
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


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that gradient checkpointing recomputes in backward."""
    return [
        module
        for module in unwrapped(model).modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and callable(getattr(module, "_gradient_checkpointing_func", None))
    ]


def _reentrant(checkpoint: object) -> bool:
    """Whether a layer's checkpoint function is torch's reentrant one (its default without `use_reentrant`)."""
    return not isinstance(checkpoint, functools.partial) or checkpoint.keywords.get("use_reentrant", True)


def can_pack(model: nn.Module) -> bool:
    """Whether `packed_forward` computes exactly what a padded forward of this model would.

    Under gradient checkpointing only with non-reentrant checkpoints (transformers' default),
    whose recompute can be given the packed attention again (`recomputed_packed`).
    """
    config = model_config(model)
    return (
        config is not None
        and config.model_type in PACKABLE_MODEL_TYPES
        and getattr(config, "sliding_window", None) is None
        and not any(_reentrant(layer._gradient_checkpointing_func) for layer in checkpointed_layers(model))
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
def recomputed_packed(model: nn.Module) -> Iterator[None]:
    """Checkpointed layers that run inside this context recompute in backward with packed attention too.

    The recompute runs the layer again long after `attention_implementation` has put the model's
    own implementation back, so each layer's checkpoint gets a `context_fn` that swaps it in again
    around the recompute (non-reentrant checkpoints only, `can_pack`).
    """
    config, layers = model_config(model), checkpointed_layers(model)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), attention_implementation(config, PACKED_ATTENTION)

    previous = [layer._gradient_checkpointing_func for layer in layers]
    for layer, checkpoint in zip(layers, previous, strict=True):
        layer._gradient_checkpointing_func = functools.partial(checkpoint, context_fn=contexts)
    try:
        yield
    finally:
        for layer, checkpoint in zip(layers, previous, strict=True):
            layer._gradient_checkpointing_func = checkpoint


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
    config = model_config(model)
    with (
        attention_implementation(config, PACKED_ATTENTION),
        recomputed_packed(model),
        output_head(model, head),
    ):
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
