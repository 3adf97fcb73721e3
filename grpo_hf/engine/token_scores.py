"""Log-probs and entropy of target tokens, from logits or from hidden states and a frozen LM head.

The (M, V) scores are walked `TOKENS_PER_CHUNK` rows at a time in float32 work buffers reused
across chunks, so no float32 copy of the whole logits (nor a softmax per chunk) is kept for
backward, which recomputes what it needs (`_TokenLogps`). With a frozen LM head (LoRA) the head's
product itself is chunked and fused in (`head_token_logps`): the (M, V) logits never exist, nor
their gradient. Logits are divided by the sampling temperature, so log-probs are those of the
distribution the completions were sampled from. Given the sampler's `Truncation`, each pass also
takes, without gradient, the log of the mass the truncation keeps of each token's distribution, the
target included (`sampler_correction.kept_floor`; a sort of each row for top_p).
"""

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from grpo_hf.algorithm.sampler_correction import Truncation, kept_floor

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


class TokenScores(NamedTuple):
    """A log-prob pass's results per target token, float32, each shaped as the targets."""

    logps: torch.Tensor  # log p(target), with a gradient to the logits
    entropy: torch.Tensor | None  # the entropy of p, when asked for
    kept_log_mass: torch.Tensor | None  # log of the mass a `Truncation` keeps (target in), no gradient


def _buffers(
    like: torch.Tensor, rows: int, vocab: int, dtypes: tuple[torch.dtype, ...]
) -> list[torch.Tensor]:
    """A (min(rows, chunk), V) work buffer per dtype, chunk = `TOKENS_PER_CHUNK`, for `_chunks`.

    Reusing them keeps the chunk loop from allocating (and, at these sizes, page-faulting in)
    fresh 12 MB tensors for every operation.
    """
    return [like.new_empty(min(rows, TOKENS_PER_CHUNK), vocab, dtype=dtype) for dtype in dtypes]


def _chunks(rows: int, buffers: list[torch.Tensor]) -> Iterator[tuple[slice, list[torch.Tensor]]]:
    """Row slices as long as the buffers, each with as many leading rows of every buffer."""
    size = buffers[0].shape[0]
    for start in range(0, rows, size):
        end = min(start + size, rows)
        yield slice(start, end), [buffer[: end - start] for buffer in buffers]


def _scaled_into(out: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`out` (c, V) float32 <- logits (c, V) / temperature."""
    out.copy_(logits)
    return out if temperature == 1.0 else out.div_(temperature)


def _score_chunk(
    z: torch.Tensor,
    e: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log p(targets), logsumexp(z), sum exp(z - max), the entropy (if asked) and the log of the mass
    `truncation` keeps (if given), each (c,), of z (c, V).

    z is float32 logits already divided by the temperature; it is left holding z - max (clamped
    at `EXP_FLOOR`) and e its exp.
    """
    top = z.amax(dim=-1, keepdim=True)  # (c, 1)
    z.sub_(top)
    target_z = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (c,)
    floor = None if truncation is None else kept_floor(z, truncation)  # (c,)
    torch.exp(z.clamp_(min=EXP_FLOOR), out=e)  # (c, V)
    total = e.sum(dim=-1)  # (c,)
    log_total = total.log()
    entropy = kept = None
    if with_entropy:  # H = log sum e - sum(e z) / sum e, with z shifted by its max
        entropy = log_total - torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) / total
    if floor is not None:  # the kept tokens' mass, and the target's where the replay cut it
        cut_target = torch.where(target_z < floor, target_z.exp(), 0.0)  # (c,)
        kept = (torch.where(z >= floor.unsqueeze(-1), e, 0.0).sum(dim=-1) + cut_target).log() - log_total
    return target_z - log_total, top.squeeze(-1) + log_total, total, entropy, kept


def _logit_grads(
    log_p: torch.Tensor,
    p: torch.Tensor,
    targets: torch.Tensor,
    log_norms: torch.Tensor,
    entropy: torch.Tensor,
    grad_logps: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    chunk: slice,
) -> torch.Tensor:
    """p (c, V) <- dL/dz of the tokens `chunk`, from log_p (c, V) holding their z = logits / T.

    dL/dz = p * c + onehot(t) * dL/dlog p_t, with c = -dL/dlog p_t - (log p + H) * dL/dH per token;
    log_p is overwritten. The caller divides by T for dL/dlogits.
    """
    log_p.sub_(log_norms[chunk].unsqueeze(-1))  # (c, V)
    torch.exp(log_p.clamp_(min=EXP_FLOOR), out=p)
    if grad_entropy is None:
        p.mul_(-grad_logps[chunk].unsqueeze(-1))
    else:
        coefficient = log_p.add_(entropy[chunk].unsqueeze(-1)).mul_(-grad_entropy[chunk].unsqueeze(-1))
        if grad_logps is not None:
            coefficient.sub_(grad_logps[chunk].unsqueeze(-1))
        p.mul_(coefficient)
    if grad_logps is not None:
        p.scatter_add_(-1, targets[chunk].unsqueeze(-1), grad_logps[chunk].unsqueeze(-1))
    return p


def _outputs(
    like: torch.Tensor, rows: int, with_entropy: bool, truncation: Truncation | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M,) float32 log-probs, entropy and kept log-mass to fill; the last two empty when not asked for."""
    logps = like.new_empty(rows, dtype=torch.float32)
    entropy = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
    kept = torch.empty_like(logps) if truncation is not None else logps.new_empty(0)
    return logps, entropy, kept


def _scores(
    outputs: tuple[torch.Tensor, ...], shape: torch.Size, with_entropy: bool, truncation: Truncation | None
) -> TokenScores:
    """The autograd functions' (M,) outputs as `TokenScores` of `shape`, None for those not asked for."""
    logps, entropy, kept = outputs
    return TokenScores(
        logps.view(shape),
        entropy.view(shape) if with_entropy else None,
        kept.view(shape) if truncation is not None else None,
    )


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits / T) at the targets, and the entropy of softmax(logits / T), per token
    (and the kept log-mass of a `Truncation`, without gradient).

    Forward and backward walk the (M, V) logits `TOKENS_PER_CHUNK` rows at a time in float32
    buffers reused across chunks, and keep only the logits (in their own dtype) and two numbers
    per token for backward, which recomputes the softmax. Autograd through the plain ops would
    keep a float32 copy of the logits and the softmax of every chunk until backward, and take
    about twice the passes over them. Gradients, with p = softmax(z), z = logits / T and H the
    entropy: d log p_t / dz = onehot(t) - p;  dH / dz = -p * (log p + H).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool, truncation: Truncation | None):
        with torch.autocast(logits.device.type, enabled=False):  # float32 throughout, bmm included
            return _TokenLogps._forward(ctx, logits, targets, temperature, with_entropy, truncation)

    @staticmethod
    def _forward(ctx, logits, targets, temperature: float, with_entropy: bool, truncation: Truncation | None):
        rows = logits.shape[0]
        logps, entropy, kept = _outputs(logits, rows, with_entropy, truncation)  # (M,) each
        log_norms = torch.empty_like(logps)  # (M,) logsumexp(z)
        scratch = _buffers(logits, rows, logits.shape[1], (torch.float32, torch.float32))
        for chunk, (z, e) in _chunks(rows, scratch):
            _scaled_into(z, logits[chunk], temperature)  # (c, V)
            logps[chunk], log_norms[chunk], _, chunk_entropy, chunk_kept = _score_chunk(
                z, e, targets[chunk], with_entropy, truncation
            )
            if with_entropy:
                entropy[chunk] = chunk_entropy
            if truncation is not None:
                kept[chunk] = chunk_kept
        ctx.save_for_backward(logits, targets, log_norms, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(kept)
        return logps, entropy, kept

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_kept: None):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return _TokenLogps._backward(ctx, grad_logps, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None
        logits, targets, log_norms, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (M, V)
        scratch = _buffers(logits, *logits.shape, (torch.float32, torch.float32))
        for chunk, (log_p, p) in _chunks(logits.shape[0], scratch):
            _scaled_into(log_p, logits[chunk], ctx.temperature)
            grads = _logit_grads(log_p, p, targets, log_norms, entropy, grad_logps, grad_entropy, chunk)
            grad[chunk] = grads if ctx.temperature == 1.0 else grads.div_(ctx.temperature)
        return grad, None, None, None, None


def token_logps_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    truncation: Truncation | None = None,
) -> TokenScores:
    """log p(targets) (...), optionally the token entropy (...) and the log of the mass `truncation`
    keeps (...) of logits (..., V), in float32.

    The first two carry gradients to the logits (the entropy's cost nothing unless something uses
    it, such as an entropy bonus); see `_TokenLogps`.
    """
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)  # (M, V), (M,)
    outputs = _TokenLogps.apply(flat_logits, flat_targets, temperature, with_entropy, truncation)
    return _scores(outputs, targets.shape, with_entropy, truncation)


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
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, dtype, truncation):
        with torch.autocast(hidden.device.type, enabled=False):  # products in `dtype`, softmax in float32
            return _HeadTokenLogps._forward(
                ctx, hidden, weight, targets, temperature, with_entropy, dtype, truncation
            )

    @staticmethod
    def _forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, dtype, truncation):
        states, weight = hidden.to(dtype), _cast_frozen(weight, dtype)  # (M, E), (V, E)
        logps, entropy, kept = _outputs(hidden, hidden.shape[0], with_entropy, truncation)  # (M,) each
        directions = torch.empty_like(states) if ctx.needs_input_grad[0] else None  # (M, E)
        for chunk, product, parts in _head_products(states, weight, temperature):
            for tokens, part, z, e in parts:
                logps[tokens], _, total, part_entropy, part_kept = _score_chunk(
                    z, e, targets[tokens], with_entropy, truncation
                )
                if with_entropy:
                    entropy[tokens] = part_entropy
                if truncation is not None:
                    kept[tokens] = part_kept
                if directions is not None:  # the logits' rows become onehot(t) - p
                    ones = e.new_ones(1, 1).expand(z.shape[0], 1)
                    product[part] = e.div_(-total.unsqueeze(-1)).scatter_add_(
                        -1, targets[tokens].unsqueeze(-1), ones
                    )
            if directions is not None:
                torch.mm(product, weight, out=directions[chunk])  # (c, E)
        ctx.save_for_backward(directions)
        ctx.temperature, ctx.hidden_dtype = temperature, hidden.dtype
        ctx.mark_non_differentiable(entropy, kept)
        return logps, entropy, kept

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor | None, _grad_entropy: None, _grad_kept: None):
        (directions,) = ctx.saved_tensors
        grad = None
        if grad_logps is not None and directions is not None:
            grad = (directions * (grad_logps / ctx.temperature).unsqueeze(-1)).to(ctx.hidden_dtype)  # (M, E)
        return grad, None, None, None, None, None, None


class _RecomputedHeadTokenLogps(torch.autograd.Function):
    """`_TokenLogps` of the logits hidden @ weight.T of any bias-free LM head, recomputed in backward.

    For a trainable head (full fine-tuning) or an entropy that needs a gradient, where
    `_HeadTokenLogps` cannot serve. Forward takes the head's product `HEAD_TOKENS_PER_CHUNK` rows
    at a time and keeps two numbers per token; backward takes each chunk's product again, turns it
    into dL/dlogits (`_logit_grads`) and multiplies it into the hidden states' gradient and, in
    float32, the weight's. No (M, V) tensor exists at any time, for one more product of the head
    than the unfused pass (whose (M, V) float32 logits and gradient reach 3 GB at 16k tokens of a
    49k vocabulary).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, dtype, truncation):
        with torch.autocast(hidden.device.type, enabled=False):  # products in `dtype`, softmax in float32
            logps, entropy, kept = _outputs(hidden, hidden.shape[0], with_entropy, truncation)  # (M,) each
            log_norms = torch.empty_like(logps)  # (M,) logsumexp(z)
            for _, _, parts in _head_products(hidden.to(dtype), weight.to(dtype), temperature):
                for tokens, _, z, e in parts:
                    logps[tokens], log_norms[tokens], _, part_entropy, part_kept = _score_chunk(
                        z, e, targets[tokens], with_entropy, truncation
                    )
                    if with_entropy:
                        entropy[tokens] = part_entropy
                    if truncation is not None:
                        kept[tokens] = part_kept
        ctx.save_for_backward(hidden, weight, targets, log_norms, entropy)
        ctx.temperature, ctx.dtype = temperature, dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(kept)
        return logps, entropy, kept

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_kept: None):
        hidden, weight, targets, log_norms, entropy = ctx.saved_tensors
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        with torch.autocast(hidden.device.type, enabled=False):
            states, cast = hidden.to(ctx.dtype), weight.to(ctx.dtype)  # (M, E), (V, E)
            grad_hidden = torch.empty_like(states) if ctx.needs_input_grad[0] else None  # (M, E)
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
            for chunk, product, parts in _head_products(states, cast, ctx.temperature):
                for tokens, part, log_p, p in parts:
                    grads = _logit_grads(
                        log_p, p, targets, log_norms, entropy, grad_logps, grad_entropy, tokens
                    )
                    product[part] = grads if ctx.temperature == 1.0 else grads.div_(ctx.temperature)
                if grad_hidden is not None:
                    torch.mm(product, cast, out=grad_hidden[chunk])  # (c, E)
                if grad_weight is not None:
                    grad_weight.add_(torch.mm(product.t(), states[chunk]))  # (V, E)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _head_products(
    states: torch.Tensor, weight: torch.Tensor, temperature: float
) -> Iterator[tuple[slice, torch.Tensor, Iterator[tuple[slice, slice, torch.Tensor, torch.Tensor]]]]:
    """states (M, E) @ weight.T (V, E) taken `HEAD_TOKENS_PER_CHUNK` rows at a time into one reused buffer.

    Yields each chunk's token slice, its (c, V) product, and its parts: `TOKENS_PER_CHUNK` rows at a
    time, (token slice, rows of the product, z, e) with z = those rows / T in a float32 buffer and
    e a second one, both reused across parts and chunks. A caller may overwrite the product's rows
    of a part once it has that part (the next part reads other rows).
    """
    rows, vocab = states.shape[0], weight.shape[0]
    products = [states.new_empty(min(rows, HEAD_TOKENS_PER_CHUNK), vocab)]
    scratch = _buffers(states, rows, vocab, (torch.float32, torch.float32))
    for chunk, (product,) in _chunks(rows, products):
        torch.mm(states[chunk], weight.t(), out=product)  # (c, V) logits
        yield chunk, product, _scaled_parts(chunk, product, scratch, temperature)


def _scaled_parts(
    chunk: slice, product: torch.Tensor, scratch: list[torch.Tensor], temperature: float
) -> Iterator[tuple[slice, slice, torch.Tensor, torch.Tensor]]:
    """`_head_products`' parts of one chunk's product."""
    for part, (z, e) in _chunks(product.shape[0], scratch):
        _scaled_into(z, product[part], temperature)
        yield slice(chunk.start + part.start, chunk.start + part.stop), part, z, e


def head_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    dtype: torch.dtype,
    entropy_grad: bool = False,
    truncation: Truncation | None = None,
) -> TokenScores:
    """log p(targets), the entropy (if `with_entropy`) and the kept log-mass of `truncation` (if
    given) of the logits hidden (M, E) @ weight.T, with weight (V, E), each (M,) float32.

    The products are taken in `dtype`. A frozen weight and an entropy without gradient take
    `_HeadTokenLogps` (no recompute); a trainable weight or `entropy_grad` take
    `_RecomputedHeadTokenLogps`.
    """
    function = _HeadTokenLogps
    if weight.requires_grad or (with_entropy and entropy_grad):
        function = _RecomputedHeadTokenLogps
    outputs = function.apply(hidden, weight, targets, temperature, with_entropy, dtype, truncation)
    return _scores(outputs, targets.shape, with_entropy, truncation)
