"""Per-token log-probs (and entropy) of completion tokens, without computing more than needed.

- Each distinct prompt goes through the model once, however many of its G completions the batch
  holds, and under autograd its gradient accumulates from all of them, exactly as if each copy had
  its own. With G = 8 and prompts as long as completions this removes almost half of the tokens of
  every forward and backward pass.
- For Llama and GPT-2 models the pass is padding-free (`packing`): the distinct prompts and the
  real completion tokens go through the model as one row, so no padding after an EOS costs a
  forward or backward. Other models run the distinct prompts once (`prefill_prompts`) and share
  their KV cache with the padded completions.
- Only the positions that predict a completion token go through the LM head (`logits_to_keep`),
  and the log-softmax is chunked (`token_scores`). In the padding-free pass a bias-free LM head
  stands in as `_ScoringHead`, fused with the log-softmax: no (tokens, V) logits at all, nor
  their gradient. A frozen head (LoRA) with an entropy that needs no gradient takes each token's
  gradient direction in forward; a trainable head (full fine-tuning) or an entropy bonus
  recompute the head's product in backward, chunk by chunk.
- On a CPU, the padded pass of other models takes SDPA's math kernel on short batches
  (`attention_kernel`): the fused flash kernel with a padding mask costs ~9 ms per layer in
  backward at 16 rows of 77 tokens, the math kernel a fraction of that; long batches keep the
  flash kernel, whose memory does not grow with length squared. The padding-free pass chooses
  its attention itself (`packing.uses_causal_rows`).
Gradient checkpointing keeps the padding-free pass (`packing.recomputed_packed`); for other
models it runs every row whole (see `completion_logps`).
"""

import contextlib
import functools
import inspect

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from grpo_hf.algorithm.sampler_correction import Truncation
from grpo_hf.engine.packing import PackedRows, can_pack, packed_forward, unwrapped
from grpo_hf.engine.token_scores import TokenScores, head_token_logps, token_logps_and_entropy
from grpo_hf.models.policy import Float32Head

# Largest rows x length^2 that takes the math attention kernel on a CPU: 16 rows of 256 tokens.
# Its backward keeps the attention weights, rows x heads x length^2 per layer.
MATH_ATTENTION_MAX = 16 * 256 * 256


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions that skip left padding, as `generate` computes them."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)


def unique_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the distinct consecutive prompt rows, and each row's index into them.

    The group sampler lays each prompt's G copies side by side, so comparing neighbours finds them.
    """
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(dim=1) & (prompt_mask[1:] == prompt_mask[:-1]).all(dim=1)
    new = torch.cat([torch.ones(1, dtype=torch.bool, device=same.device), ~same])  # (B,)
    return new.nonzero().squeeze(1), new.long().cumsum(dim=0) - 1  # (U,), (B,)


def cache_keyword(model: nn.Module) -> str:
    """The keyword by which `model`'s forward takes a KV cache: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); earlier versions and
    remote-code models keep the old one. A PEFT, DDP or DeepSpeed wrapper hands it on to the
    transformers model inside, whose forward decides."""
    inner = next((module for module in model.modules() if isinstance(module, PreTrainedModel)), model)
    return _forward_cache_keyword(type(inner))


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def prefill_prompts(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, DynamicCache]:
    """Run each distinct prompt once: (B, V) logits after every row's prompt, and a KV cache of B rows."""
    first, row_to_unique = unique_rows(prompt_ids, prompt_mask)  # (U,), (B,)
    cache = DynamicCache()
    out = model(
        input_ids=prompt_ids[first],
        attention_mask=prompt_mask[first],
        position_ids=position_ids_from_mask(prompt_mask[first]),
        use_cache=True,
        **{cache_keyword(model): cache},
        logits_to_keep=1,
    )
    cache.batch_select_indices(row_to_unique)  # an index op: differentiable
    return out.logits[row_to_unique, -1], cache  # (B, V)


def attention_kernel(input_ids: torch.Tensor) -> contextlib.AbstractContextManager:
    """SDPA's math kernel for short batches on a CPU; otherwise whatever SDPA picks."""
    rows, length = input_ids.shape
    if input_ids.device.type == "cpu" and rows * length * length <= MATH_ATTENTION_MAX:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def completion_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    share_prompts: bool = True,
) -> torch.Tensor:
    """(B, C, V) logits predicting each of the last C tokens of input_ids.

    `share_prompts=False` runs every row whole: needed under gradient checkpointing, which turns
    the KV cache off in training mode.
    """
    positions = position_ids_from_mask(attention_mask)  # (B, T)
    if not share_prompts:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            logits_to_keep=completion_length + 1,
            use_cache=False,
        )
        return out.logits[:, :-1]  # (B, C, V): the last position predicts beyond the sequence
    prompt_length = input_ids.shape[1] - completion_length
    first, cache = prefill_prompts(model, input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    # All C completion tokens go in, though the last one's logits predict beyond the sequence: every
    # process then makes the same two model calls whatever its completion widths, which DDP (buffer
    # broadcasts) and FSDP (all-gathers) need.
    out = model(
        input_ids=input_ids[:, prompt_length:],
        attention_mask=attention_mask,
        position_ids=positions[:, prompt_length:],
        use_cache=True,
        **{cache_keyword(model): cache},
    )
    return torch.cat([first.unsqueeze(1), out.logits[:, :-1]], dim=1)  # (B, C, V)


class _ScoringHead(nn.Module):
    """Stands in for a model's LM head for one call: (1, K, E) hidden -> `TokenScores` of (K,)."""

    def __init__(
        self,
        head: nn.Linear,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        truncation: Truncation | None,
    ):
        super().__init__()
        self.head, self.targets = head, targets  # (K,)
        self.temperature, self.with_entropy, self.entropy_grad = temperature, with_entropy, entropy_grad
        self.truncation = truncation

    def forward(self, hidden: torch.Tensor) -> TokenScores:
        device = hidden.device.type
        weight = self.head.weight  # (V, E)
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        if isinstance(self.head, Float32Head):
            dtype = torch.float32
        return head_token_logps(
            hidden.squeeze(0),
            weight,
            self.targets,
            self.temperature,
            self.with_entropy,
            dtype,
            self.entropy_grad,
            self.truncation,
        )  # (K,) each


def scoring_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head if `token_scores.head_token_logps` can take its place: a whole, bias-free Linear."""
    head = unwrapped(model).get_output_embeddings()
    return (
        head
        if type(head) in (nn.Linear, Float32Head)
        and head.bias is None
        and type(head.weight.data) is torch.Tensor  # not an FSDP2 shard
        and not hasattr(head.weight, "ds_id")  # not a DeepSpeed ZeRO-3 partition
        else None
    )


def packed_completion_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    truncation: Truncation | None = None,
) -> TokenScores:
    """`completion_logps` in one model call on the batch's real tokens (see `packing`); 0 at padding.

    The packed row is the distinct prompts, then the completions. A row's first completion token
    is predicted at its prompt's last token, token j > 0 at its token j - 1, so the LM head runs
    on each row's prompt's last token (repeated per row, so one log-softmax call covers every kept
    position and its backward writes one gradient tensor) and on every completion token but each
    row's last. A bias-free LM head is fused with the log-softmax (`token_scores.head_token_logps`).
    """
    prompt_length = input_ids.shape[1] - completion_length
    prompt_ids, prompt_mask = input_ids[:, :prompt_length], attention_mask[:, :prompt_length]  # (B, P)
    real = attention_mask[:, prompt_length:].bool()  # (B, C)
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("completion attention masks must be ones then zeros (right padding only)")
    first, row_to_unique = unique_rows(prompt_ids, prompt_mask)  # (U,), (B,)
    prompt_real = prompt_mask[first].bool()  # (U, P)
    completion = input_ids[:, prompt_length:]  # (B, C)
    positions = position_ids_from_mask(attention_mask)  # (B, P + C)
    prompt_ends = prompt_real.sum(dim=1).cumsum(dim=0) - 1  # (U,) each prompt's last packed token
    has_next = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)[real]  # (N,)
    rows, later = real.shape[0], real[:, 1:]  # later: (B, C - 1) the real tokens after each first one
    targets = torch.cat([completion[:, 0], completion[:, 1:][later]])  # (B + K,)
    head = scoring_head(model)
    out = packed_forward(
        model,
        torch.cat([prompt_ids[first][prompt_real], completion[real]]),  # (U prompts' + N tokens,)
        torch.cat([positions[first, :prompt_length][prompt_real], positions[:, prompt_length:][real]]),
        torch.cat([prompt_ends[row_to_unique], prompt_ends[-1] + 1 + has_next.nonzero().squeeze(1)]),
        PackedRows(prompt_real, row_to_unique, real),
        head=_ScoringHead(head, targets, temperature, with_entropy, entropy_grad, truncation)
        if head
        else None,
    )  # (B + K, V) logits, or with a fused head their (B + K,) `TokenScores`
    scores = out if head else token_logps_and_entropy(out, targets, temperature, with_entropy, truncation)
    return TokenScores(
        *(
            None
            if flat is None
            else torch.cat(
                [flat[:rows].unsqueeze(1), flat.new_zeros(later.shape).masked_scatter(later, flat[rows:])], 1
            )
            for flat in scores
        )
    )  # (B, C) each


def completion_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    gradient_checkpointing: bool = False,
    entropy_grad: bool = True,
    truncation: Truncation | None = None,
) -> TokenScores:
    """Log-probs (B, C) of the last C tokens of input_ids under `model`, their entropy if asked, and
    the log of the mass the sampler's `truncation` keeps at each (`token_scores`), if given.

    Models `packing` supports get a padding-free pass (values at padding positions are 0), with
    gradient checkpointing too (its recompute is given the packed attention again); others a
    padded one with shared prompts. For those, `gradient_checkpointing=True` (the model recomputes
    activations in backward) runs every row whole with SDPA's default kernel: checkpointing turns
    the KV cache off, and the recompute runs outside any kernel choice made here, so it must not
    depend on one. `entropy_grad=False` returns the entropy detached (a metric, not a loss term),
    which spares a frozen LM head's product in backward in the padding-free pass.
    """
    if can_pack(model):
        scores = packed_completion_logps(
            model,
            input_ids,
            attention_mask,
            completion_length,
            temperature,
            with_entropy,
            entropy_grad,
            truncation,
        )
    else:
        with contextlib.nullcontext() if gradient_checkpointing else attention_kernel(input_ids):
            logits = completion_logits(  # (B, C, V)
                model, input_ids, attention_mask, completion_length, share_prompts=not gradient_checkpointing
            )
        targets = input_ids[:, -completion_length:]  # (B, C)
        scores = token_logps_and_entropy(logits, targets, temperature, with_entropy, truncation)
    entropy = scores.entropy
    return scores._replace(entropy=entropy if entropy is None or entropy_grad else entropy.detach())
