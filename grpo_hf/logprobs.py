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
  and the log-softmax is taken 64 tokens at a time in float32, so without autograd the full
  (tokens, V) float32 tensor never exists for a bf16 model. In the padding-free pass a frozen LM
  head (LoRA) is fused with the log-softmax (`_HeadTokenLogps`): no (tokens, V) logits at all,
  nor their gradient, unless the entropy needs a gradient (an entropy bonus).
- On a CPU, short batches use SDPA's math kernel (`attention_kernel`): the fused flash kernel
  costs ~9 ms per layer in backward at 16 rows of 77 tokens, the math kernel a fraction of that;
  long batches keep the flash kernel, whose memory does not grow with length squared.
Under gradient checkpointing none of this applies (see `completion_logps`).
Logits are divided by the sampling temperature, so log-probs are those of the distribution the
completions were sampled from.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.weak import WeakTensorKeyDictionary
from transformers import DynamicCache

from grpo_hf.packing import PackedRows, can_pack, packed_forward, unwrapped

# Largest rows x length^2 that takes the math attention kernel on a CPU: 16 rows of 256 tokens.
# Its backward keeps the attention weights, rows x heads x length^2 per layer.
MATH_ATTENTION_MAX = 16 * 256 * 256
TOKENS_PER_CHUNK = 64
# The fused LM head multiplies this many rows at a time (its log-softmax still takes
# TOKENS_PER_CHUNK): each chunk reads the head's whole weight, and at V = 49k on a CPU the
# products run ~30% slower in chunks of 64 rows, ~10% in chunks of 128.
HEAD_TOKENS_PER_CHUNK = 256
# exp() of a float32 below about -87.3 is denormal or 0, and PyTorch's vectorized exp takes a slow
# path there: 7x slower over [-120, 0], where most of a 49k vocabulary's shifted logits lie. Every
# exp here is of a logit minus the row's max (or its logsumexp); clamping at the floor changes
# each such term by under 2e-38, and their sum (at least exp(0) = 1) not at all in float32.
EXP_FLOOR = -87.0


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
        past_key_values=cache,
        use_cache=True,
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
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first.unsqueeze(1), out.logits[:, :-1]], dim=1)  # (B, C, V)


def _chunks(
    like: torch.Tensor, rows: int, vocab: int, dtypes: tuple[torch.dtype, ...], size: int = TOKENS_PER_CHUNK
) -> Iterator[tuple[slice, list[torch.Tensor]]]:
    """Row slices of `size`, each with a (c, V) work buffer per dtype, the same buffers for every chunk.

    Reusing them keeps the chunk loop from allocating (and, at these sizes, page-faulting in)
    fresh 12-25 MB tensors for every operation.
    """
    buffers = [like.new_empty(min(rows, size), vocab, dtype=dtype) for dtype in dtypes]
    for start in range(0, rows, size):
        end = min(start + size, rows)
        yield slice(start, end), [buffer[: end - start] for buffer in buffers]


def _scaled_into(out: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`out` (c, V) float32 <- logits (c, V) / temperature."""
    out.copy_(logits)
    return out if temperature == 1.0 else out.div_(temperature)


def _score_chunk(
    z: torch.Tensor, e: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """log p(targets), logsumexp(z), sum exp(z - max) and the entropy (if asked), each (c,), of z (c, V).

    z is float32 logits already divided by the temperature; it is left holding z - max (clamped
    at `EXP_FLOOR`) and e its exp.
    """
    top = z.amax(dim=-1, keepdim=True)  # (c, 1)
    z.sub_(top)
    target_z = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (c,)
    torch.exp(z.clamp_(min=EXP_FLOOR), out=e)  # (c, V)
    total = e.sum(dim=-1)  # (c,)
    log_total = total.log()
    entropy = None
    if with_entropy:  # H = log sum e - sum(e z) / sum e, with z shifted by its max
        entropy = log_total - torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) / total
    return target_z - log_total, top.squeeze(-1) + log_total, total, entropy


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits / T) at the targets, and the entropy of softmax(logits / T), per token.

    Forward and backward walk the (M, V) logits `TOKENS_PER_CHUNK` rows at a time in float32
    buffers reused across chunks, and keep only the logits (in their own dtype) and two numbers
    per token for backward, which recomputes the softmax. Autograd through the plain ops would
    keep a float32 copy of the logits and the softmax of every chunk until backward, and take
    about twice the passes over them. Gradients, with p = softmax(z), z = logits / T and H the
    entropy: d log p_t / dz = onehot(t) - p;  dH / dz = -p * (log p + H).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        with torch.autocast(logits.device.type, enabled=False):  # float32 throughout, bmm included
            return _TokenLogps._forward(ctx, logits, targets, temperature, with_entropy)

    @staticmethod
    def _forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        rows = logits.shape[0]
        logps = logits.new_empty(rows, dtype=torch.float32)  # (M,)
        log_norms = torch.empty_like(logps)  # (M,) logsumexp(z)
        entropy = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        for chunk, (z, e) in _chunks(logits, rows, logits.shape[1], (torch.float32, torch.float32)):
            _scaled_into(z, logits[chunk], temperature)  # (c, V)
            logps[chunk], log_norms[chunk], _, chunk_entropy = _score_chunk(
                z, e, targets[chunk], with_entropy
            )
            if with_entropy:
                entropy[chunk] = chunk_entropy
        ctx.save_for_backward(logits, targets, log_norms, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return _TokenLogps._backward(ctx, grad_logps, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        """dL/dz = p * c + onehot(t) * dL/dlog p_t, with c = -dL/dlog p_t - (log p + H) * dL/dH per token."""
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None
        logits, targets, log_norms, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (M, V)
        for chunk, (log_p, p) in _chunks(logits, *logits.shape, (torch.float32, torch.float32)):
            _scaled_into(log_p, logits[chunk], ctx.temperature).sub_(log_norms[chunk].unsqueeze(-1))  # (c, V)
            torch.exp(log_p.clamp_(min=EXP_FLOOR), out=p)
            if grad_entropy is None:
                p.mul_(-grad_logps[chunk].unsqueeze(-1))
            else:
                coefficient = log_p.add_(entropy[chunk].unsqueeze(-1)).mul_(
                    -grad_entropy[chunk].unsqueeze(-1)
                )
                if grad_logps is not None:
                    coefficient.sub_(grad_logps[chunk].unsqueeze(-1))
                p.mul_(coefficient)
            if grad_logps is not None:
                p.scatter_add_(-1, targets[chunk].unsqueeze(-1), grad_logps[chunk].unsqueeze(-1))
            grad[chunk] = p if ctx.temperature == 1.0 else p.div_(ctx.temperature)
        return grad, None, None, None


def token_logps_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) (...) and optionally the token entropy (...) of logits (..., V), in float32.

    Both carry gradients to the logits (the entropy's cost nothing unless something uses it, such
    as an entropy bonus); see `_TokenLogps`.
    """
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)  # (M, V), (M,)
    logps, entropy = _TokenLogps.apply(flat_logits, flat_targets, temperature, with_entropy)
    return logps.view(targets.shape), entropy.view(targets.shape) if with_entropy else None


# Each frozen LM head weight's copy in a lower precision, with the (storage, version) it was cast at.
_CASTS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _cast_frozen(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`, cast again only when the weight changed (its storage or version counter).

    Under autocast a frozen weight is cast at every use: for a 49k x 576 head, a fresh 57 MB
    tensor per pass. The copy is kept while the weight lives.
    """
    if weight.dtype == dtype:
        return weight
    stamp = (weight.data_ptr(), weight._version, dtype)
    cached = _CASTS.get(weight)
    if cached is None or cached[0] != stamp:
        cached = _CASTS[weight] = (stamp, weight.detach().to(dtype))
    return cached[1]


class _HeadTokenLogps(torch.autograd.Function):
    """`_TokenLogps` of the logits hidden @ weight.T of a frozen LM head, without the (M, V) logits.

    The head's product is taken `HEAD_TOKENS_PER_CHUNK` rows at a time, in `dtype` (the autocast dtype
    the model's own head would compute in), into a reused buffer. When the hidden states need a
    gradient, forward also takes each token's d log p_t / d hidden = (onehot(t) - p) @ weight / T,
    the product backward would otherwise take with the whole logits gradient; backward is then a
    multiply by the incoming gradient. The FLOPs are the unfused pass's; gone are the (M, V)
    logits, their float32 copy (Accelerate casts a bf16 model's outputs to float32) and their
    gradient, each a fresh allocation of 60-110 MB per pass at the benchmark's shapes. The
    entropy comes without a gradient: an entropy bonus takes the unfused path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, dtype: torch.dtype):
        with torch.autocast(hidden.device.type, enabled=False):  # products in `dtype`, softmax in float32
            return _HeadTokenLogps._forward(ctx, hidden, weight, targets, temperature, with_entropy, dtype)

    @staticmethod
    def _forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, dtype: torch.dtype):
        rows, vocab = hidden.shape[0], weight.shape[0]
        states, weight = hidden.to(dtype), _cast_frozen(weight, dtype)  # (M, E), (V, E)
        logps = hidden.new_empty(rows, dtype=torch.float32)  # (M,)
        entropy = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        directions = torch.empty_like(states) if ctx.needs_input_grad[0] else None  # (M, E)
        for chunk, (product,) in _chunks(hidden, rows, vocab, (dtype,), HEAD_TOKENS_PER_CHUNK):
            torch.mm(states[chunk], weight.t(), out=product)  # (c, V) logits
            for part, (z, e) in _chunks(hidden, product.shape[0], vocab, (torch.float32, torch.float32)):
                tokens = slice(chunk.start + part.start, chunk.start + part.stop)
                _scaled_into(z, product[part], temperature)
                logps[tokens], _, total, part_entropy = _score_chunk(z, e, targets[tokens], with_entropy)
                if with_entropy:
                    entropy[tokens] = part_entropy
                if directions is not None:  # the logits' rows become onehot(t) - p
                    ones = e.new_ones(1, 1).expand(z.shape[0], 1)
                    product[part] = e.div_(-total.unsqueeze(-1)).scatter_add_(
                        -1, targets[tokens].unsqueeze(-1), ones
                    )
            if directions is not None:
                torch.mm(product, weight, out=directions[chunk])  # (c, E)
        ctx.save_for_backward(directions)
        ctx.temperature, ctx.hidden_dtype = temperature, hidden.dtype
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: None):
        (directions,) = ctx.saved_tensors
        grad = None
        if grad_logps is not None and directions is not None:
            grad = (directions * (grad_logps / ctx.temperature).unsqueeze(-1)).to(ctx.hidden_dtype)  # (M, E)
        return grad, None, None, None, None, None


class _ScoringHead(nn.Module):
    """Stands in for a model's frozen LM head for one call: (1, K, E) hidden -> log-probs, entropy (K,)."""

    def __init__(self, head: nn.Linear, targets: torch.Tensor, temperature: float, with_entropy: bool):
        super().__init__()
        self.head, self.targets = head, targets  # (K,)
        self.temperature, self.with_entropy = temperature, with_entropy

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = hidden.device.type
        weight = self.head.weight  # (V, E)
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        logps, entropy = _HeadTokenLogps.apply(
            hidden.squeeze(0), weight, self.targets, self.temperature, self.with_entropy, dtype
        )  # (K,) each
        return logps, entropy if self.with_entropy else None


def frozen_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head if `_HeadTokenLogps` can take its place: a frozen, whole, bias-free Linear."""
    head = unwrapped(model).get_output_embeddings()
    return (
        head
        if type(head) is nn.Linear
        and head.bias is None
        and not head.weight.requires_grad
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logps` in one model call on the batch's real tokens (see `packing`); 0 at padding.

    The packed row is the distinct prompts, then the completions. A row's first completion token
    is predicted at its prompt's last token, token j > 0 at its token j - 1, so the LM head runs
    on each row's prompt's last token (repeated per row, so one log-softmax call covers every kept
    position and its backward writes one gradient tensor) and on every completion token but each
    row's last. A frozen LM head is fused with the log-softmax (`_HeadTokenLogps`) unless the
    entropy needs a gradient.
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
    head = None if with_entropy and entropy_grad else frozen_head(model)
    out = packed_forward(
        model,
        torch.cat([prompt_ids[first][prompt_real], completion[real]]),  # (U prompts' + N tokens,)
        torch.cat([positions[first, :prompt_length][prompt_real], positions[:, prompt_length:][real]]),
        torch.cat([prompt_ends[row_to_unique], prompt_ends[-1] + 1 + has_next.nonzero().squeeze(1)]),
        PackedRows(prompt_real, row_to_unique, real),
        head=head and _ScoringHead(head, targets, temperature, with_entropy),
    )  # (B + K, V) logits, or with a fused head (B + K,) log-probs and entropy
    scores = out if head else token_logps_and_entropy(out, targets, temperature, with_entropy)
    logps, entropy = (
        None
        if flat is None
        else torch.cat(
            [flat[:rows].unsqueeze(1), flat.new_zeros(later.shape).masked_scatter(later, flat[rows:])], 1
        )
        for flat in scores
    )  # (B, C) each
    return logps, entropy


def completion_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    gradient_checkpointing: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of the last C tokens of input_ids under `model`, and their entropy if asked.

    Models `packing` supports get a padding-free pass (values at padding positions are 0); others
    a padded one with shared prompts. `gradient_checkpointing=True` (the model recomputes
    activations in backward) runs every row whole with SDPA's default kernel: checkpointing turns
    the KV cache off, and the recompute runs outside any kernel choice made here, so it must not
    depend on one. `entropy_grad=False` returns the entropy detached (a metric, not a loss term),
    which lets the padding-free pass fuse a frozen LM head with the log-softmax.
    """
    kernel = contextlib.nullcontext() if gradient_checkpointing else attention_kernel(input_ids)
    with kernel:
        if not gradient_checkpointing and can_pack(model):
            logps, entropy = packed_completion_logps(
                model, input_ids, attention_mask, completion_length, temperature, with_entropy, entropy_grad
            )
        else:
            logits = completion_logits(  # (B, C, V)
                model, input_ids, attention_mask, completion_length, share_prompts=not gradient_checkpointing
            )
            targets = input_ids[:, -completion_length:]  # (B, C)
            logps, entropy = token_logps_and_entropy(logits, targets, temperature, with_entropy)
    return logps, entropy if entropy is None or entropy_grad else entropy.detach()
