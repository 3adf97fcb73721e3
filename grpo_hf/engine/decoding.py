"""Prompt prefill and decoding steps: prompts in, then one new token per row, next-token logits out.

Generation is most of GRPO's cost. Through the transformers module stack a decoding step of a
small model pays for many small tensor operations per layer, a `DynamicCache` that concatenates
every layer's keys and values at every step, and (with the float32 decode attention of
`generation_copy`) a cast of the whole cache each time. For Llama-architecture models
(`LlamaForCausalLM`: SmolLM2, Llama 2/3, TinyLlama, ...) `LlamaDecoder` runs the same computation
directly on the model's weights:
- q/k/v and gate/up projections are one matmul each, on weights reordered into oneDNN's blocked
  layout on a CPU that supports it for the weights' dtype (`cpu.BlockedLinear`; plain `F.linear`
  elsewhere), for the prompt prefill too; a weight is reordered again only when it changed
  (`cpu.BlockedWeights`: with LoRA, the merged projections once per round);
- each distinct prompt is prefilled once; keys and values go into a float32 cache allocated once
  for the whole completion, and attention is `attention.grouped_attention` over it;
- RMSNorm, RoPE and the residual stream round exactly where transformers' Llama does (tests
  compare logits step by step).
`StaticLlamaDecoder` is the same maths in fixed shapes on a static cache, each step sampling
inside and replayed as a CUDA graph on a GPU (`fixed_shape`); `decoder_for` takes it on a CUDA
device. Any other model (GPT-2, a PEFT wrapper with unmerged adapters, sharded parameters) prefills
and decodes through `model(...)`: with a `DynamicCache` (`TransformersDecoder`), or on a CUDA device,
where transformers can run the model's forward on a static cache, in fixed shapes replayed as CUDA
graphs (`model_forward.StaticForwardDecoder`). `bench/levers.py` times a step of each on the
benchmark's shapes.
"""

import functools
import importlib.util
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from grpo_hf.engine import fixed_shape
from grpo_hf.engine.attention import bias_from, causal_allowed, grouped_attention
from grpo_hf.engine.cpu import BlockedLinear, BlockedWeights
from grpo_hf.engine.logprobs import Float32Head, position_ids_from_mask, unique_rows
from grpo_hf.engine.model_forward import (
    StaticForwardDecoder,
    TransformersDecoder,
    static_cache_problem,
    whole_local_weights,
)
from grpo_hf.engine.quantization import quantization_of


def is_plain_llama(model: nn.Module) -> bool:
    """A transformers Llama whose computation `LlamaDecoder` reproduces, with whole local weights."""
    config = getattr(model, "config", None)
    return (
        type(model).__name__ == "LlamaForCausalLM"
        and getattr(config, "model_type", None) == "llama"
        and config.hidden_act == "silu"
        and not config.attention_bias
        and not config.mlp_bias
        and getattr(config, "pretraining_tp", 1) in (None, 1)
        # Dynamic RoPE rescales with the longest position seen so far, step by step in transformers;
        # LlamaDecoder computes every position's rotation up front.
        and (getattr(config, "rope_parameters", None) or {}).get("rope_type") != "dynamic"
        and whole_local_weights(model)
    )


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in float32, round to the input dtype, then scale."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (..., D) with its first half negated, for `_rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (..., heads, D) with (..., 1, D) cos / `_signed_sin`, as transformers' apply_rotary_pos_emb.

    rotate_half(x) * sin == roll(x, D / 2) * signed_sin exactly (negation commutes with rounding),
    with one roll instead of two slices, a negation and a concatenation per call.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _feed_forward(
    hidden: torch.Tensor, norm: torch.Tensor, gate_up: BlockedLinear, down: BlockedLinear, eps: float
) -> torch.Tensor:
    """hidden (..., E) plus Llama's SwiGLU MLP of its RMS-normed self."""
    gate, up = gate_up(_rms_norm(hidden, norm, eps).view(-1, hidden.shape[-1])).chunk(2, dim=-1)
    return hidden + down(F.silu(gate) * up).view(hidden.shape)


_BLOCKED_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, BlockedWeights]" = weakref.WeakKeyDictionary()


def _layer_matmuls(model: nn.Module) -> list[tuple[nn.Module, ...]]:
    """The layers of a decoding step's matmuls, per decoder layer: q/k/v, o, gate/up, down (a fused
    group's layers together)."""
    groups = []
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        groups += [
            (attention.q_proj, attention.k_proj, attention.v_proj),
            (attention.o_proj,),
            (mlp.gate_proj, mlp.up_proj),
            (mlp.down_proj,),
        ]
    return groups


def _matmul_weights(model: nn.Module, head: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The weights of a decoding step's matmuls: each group of `_layer_matmuls`; then the LM head's."""
    return [*(tuple(layer.weight for layer in group) for group in _layer_matmuls(model)), (head,)]


def _matmul_makers(model: nn.Module) -> list[type]:
    """How each matmul of `_matmul_weights` multiplies: as its (first) layer's `quantized_matmul` where
    `quantization.quantize_linears` quantized it (a float32 LM head stays float), else on oneDNN's
    blocked weights (`BlockedLinear`). A fused group (q/k/v, gate/up) multiplies as its first layer."""
    firsts = [group[0] for group in _layer_matmuls(model)]
    return [getattr(module, "quantized_matmul", BlockedLinear) for module in (*firsts, model.lm_head)]


class LlamaDecoder:
    """Prefill and decoding steps of a `LlamaForCausalLM` on its weights, with a float32 KV cache.

    Both run in inference mode (no version counters or view tracking: ~2 ms of a 35 ms decoding
    step); their cache, reordered weights and logits are inference tensors, read outside only by
    functional ops (sampling).
    """

    def __init__(self, model: nn.Module, max_new_tokens: int):
        config = model.config
        self.model, self.max_new_tokens = model, max_new_tokens
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qk_v = [self.q_size + kv_size, kv_size]  # the q/k/v matmul's output: q and k (rotated), v
        self.eps = config.rms_norm_eps
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        head = model.lm_head  # a Float32Head (cast_lm_head_to_fp32) multiplies in float32, tied or not
        self.head_weight = head.weight.float() if isinstance(head, Float32Head) else head.weight  # (V, E)

    def _linears(self, rows: int) -> list:
        """The step's matmuls in `_matmul_weights`' order, as callables x -> x @ W.T, for `rows` rows."""
        groups = _matmul_weights(self.model, self.head_weight)
        blocked = _BLOCKED_WEIGHTS.setdefault(self.model, BlockedWeights())
        return blocked.reorder(groups, rows, _matmul_makers(self.model))

    def _new_cache(self, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's keys and values, (B, KV, P + N, D) float32."""
        keys = [self.embed.new_empty(shape, dtype=torch.float32) for _ in self.layers]
        return keys, [torch.empty_like(k) for k in keys]

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Run the (B, P) left-padded prompts (each distinct one once); (B, V) float32 next-token logits."""
        model, (rows, prompt_length) = self.model, prompt_ids.shape
        *matmuls, self.lm_head = self._linears(rows)
        self.layers = [  # norm, q/k/v, o, norm, gate/up, down
            (layer.input_layernorm.weight, *matmuls[4 * i : 4 * i + 2])
            + (layer.post_attention_layernorm.weight, *matmuls[4 * i + 2 : 4 * i + 4])
            for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers])
        ]
        width = prompt_length + self.max_new_tokens
        self.keys, self.values = self._new_cache((rows, self.kv_heads, width, self.head_dim))
        visible = F.pad(prompt_mask.bool(), (0, self.max_new_tokens), value=True)  # (B, P + N)
        self.mask = bias_from(visible.unsqueeze(1))  # (B, 1, 1, P + N)
        first_position = position_ids_from_mask(prompt_mask)[:, -1:] + 1  # (B, 1)
        positions = first_position + torch.arange(self.max_new_tokens, device=prompt_mask.device)  # (B, N)
        cos, sin = model.model.rotary_emb(self.embed, positions)  # (B, N, D) each, in the weights' dtype
        self.cos, self.signed_sin = cos.unsqueeze(2), _signed_sin(sin).unsqueeze(2)  # (B, N, 1, D)
        self.prompt_length, self.step = prompt_length, 0

        first, row_to_unique = unique_rows(prompt_ids, prompt_mask)  # (U,), (B,)
        real = prompt_mask[first].bool()  # (U, P)
        cos, sin = model.model.rotary_emb(self.embed, position_ids_from_mask(real))  # (U, P, D) each
        cos, signed_sin = cos.unsqueeze(2), _signed_sin(sin).unsqueeze(2)  # (U, P, 1, D)
        bias = bias_from(causal_allowed(real))  # (U, 1, P, P)
        hidden = F.embedding(prompt_ids[first], self.embed)  # (U, P, E)
        for i in range(len(self.layers)):
            hidden = self._prefill_layer(i, hidden, cos, signed_sin, bias, row_to_unique)
        return self.lm_head(
            _rms_norm(hidden[:, -1], self.final_norm, self.eps).to(self.head_weight.dtype)
        ).float()[row_to_unique]  # (B, V)

    def _prefill_layer(
        self,
        i: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        bias: torch.Tensor,
        row_to_unique: torch.Tensor,
    ) -> torch.Tensor:
        """Layer i on (U, P, E) prompts; writes their keys and values into every row of the cache."""
        norm_in, qkv, out_proj, norm_post, gate_up, down = self.layers[i]
        units, length, width = hidden.shape
        qk, v = qkv(_rms_norm(hidden, norm_in, self.eps).view(-1, width)).split(self.qk_v, -1)
        qk = _rotate(qk.view(units, length, -1, self.head_dim), cos, signed_sin)  # (U, P, H + KV, D)
        q, k = (
            qk[:, :, : self.heads].transpose(1, 2),
            qk[:, :, self.heads :].transpose(1, 2),
        )  # (U, H|KV, P, D)
        v = v.view(units, length, self.kv_heads, self.head_dim).transpose(1, 2)  # (U, KV, P, D)
        self.keys[i][:, :, :length] = k[row_to_unique]
        self.values[i][:, :, :length] = v[row_to_unique]
        attention = (
            grouped_attention(q, k, v, bias).transpose(1, 2).reshape(-1, self.q_size)
        )  # (U * P, H * D)
        hidden = hidden + out_proj(attention).view(units, length, width)
        return _feed_forward(hidden, norm_post, gate_up, down, self.eps)

    @torch.inference_mode()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Feed (B,) tokens; (B, V) float32 logits for the next ones."""
        column = self.prompt_length + self.step  # the new token's cache column
        cos, signed_sin = self.cos[:, self.step], self.signed_sin[:, self.step]  # (B, 1, D)
        logits = self._forward_token(token, cos, signed_sin, self.mask[..., : column + 1], column)
        self.step += 1
        return logits

    def _forward_token(
        self,
        token: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        mask: torch.Tensor,
        column: int | torch.Tensor,
    ) -> torch.Tensor:
        """(B,) tokens through every layer, their keys and values written at cache `column`, with
        their (B, 1, D) rotation and (B, 1, 1, L) attention bias; (B, V) float32 next-token logits."""
        rows = token.shape[0]
        hidden = F.embedding(token, self.embed)  # (B, E)
        for i, (norm_in, qkv, out_proj, norm_post, gate_up, down) in enumerate(self.layers):
            qk, v = qkv(_rms_norm(hidden, norm_in, self.eps)).split(self.qk_v, -1)
            qk = _rotate(
                qk.view(rows, self.heads + self.kv_heads, self.head_dim), cos, signed_sin
            )  # (B, H + KV, D)
            q = qk[:, : self.heads]  # (B, H, D)
            keys, values = self._write_cache(
                i, column, qk[:, self.heads :], v.view(rows, self.kv_heads, self.head_dim)
            )  # (B, KV, L, D) each
            attention = grouped_attention(q.unsqueeze(2), keys, values, mask).view(
                rows, self.q_size
            )  # (B, H * D)
            hidden = _feed_forward(hidden + out_proj(attention), norm_post, gate_up, down, self.eps)
        return self.lm_head(
            _rms_norm(hidden, self.final_norm, self.eps).to(self.head_weight.dtype)
        ).float()  # (B, V)

    def _write_cache(
        self, i: int, column: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's new (B, KV, D) keys and values into the cache at `column`; the (B, KV, L, D)
        keys and values attended to (those written so far)."""
        self.keys[i][:, :, column] = keys
        self.values[i][:, :, column] = values
        return self.keys[i][:, :, : column + 1], self.values[i][:, :, : column + 1]

    @torch.inference_mode()
    def keep(self, rows: torch.Tensor) -> None:
        """Go on decoding only `rows` (indices into the current rows), in that order.

        Each layer's cache is copied up to the columns written so far; the rest is never read
        before it is written.
        """
        written = self.prompt_length + self.step
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                cache[i] = old.new_empty((len(rows), *old.shape[1:]))
                cache[i][:, :, :written] = old[rows, :, :written]
        self.mask, self.cos, self.signed_sin = self.mask[rows], self.cos[rows], self.signed_sin[rows]


class StaticLlamaDecoder(LlamaDecoder):
    """`LlamaDecoder` in fixed shapes (`fixed_shape`): a static cache per shape bucket, in the
    weights' dtype on a GPU (float32 on a CPU), rows kept to the end, sampling inside the step, and
    on CUDA each step replayed as a CUDA graph. The prefill is `LlamaDecoder`'s, on the bucket's
    padded prompts; the step is its `_forward_token` with the step, the cache column and the
    attention bias held on the device. `fixed_shape.decode` drives it, in place of the loop's
    prefill / step / keep.
    """

    CAPTURE_FALLBACK = (
        "set generation_backend='llama_static' to decode without torch.compile, "
        "or 'llama' without CUDA graphs"
    )

    def __init__(self, model: nn.Module, max_new_tokens: int, compiled: bool = False):
        super().__init__(model, fixed_shape.bucket(max_new_tokens))
        self.buffers = fixed_shape.buffers_of(model)
        self.vocab = model.lm_head.weight.shape[0]
        self.compiled = compiled  # the step's model part through torch.compile (`fixed_shape.compile_step`)

    def _linears(self, rows: int) -> list:
        """Plain matmuls on the joined weights; with rollout_quantization='fp8' each group's
        `Fp8Matmul`, rounded again in place when a weight changed (`cpu.BlockedWeights`), so a
        captured step reads the new weights where it read the old ones. None are on oneDNN's packed
        weights (`rows` None), which neither a CUDA graph nor `torch.compile` can read."""
        groups = _matmul_weights(self.model, self.head_weight)
        if quantization_of(self.model) is None:
            self.weights = self.buffers.joins.join(groups)
            return [functools.partial(F.linear, weight=weight) for weight in self.weights]
        matmuls = self.buffers.quantized.reorder(groups, None, _matmul_makers(self.model))
        self.weights = [tensor for matmul in matmuls for tensor in matmul.tensors()]
        return matmuls

    def _new_cache(self, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The state's cache; its new-token columns zeroed (the bias masks them until written:
        probability 0 times a finite value)."""
        cache = self.state.own(self)
        if "keys" not in cache:
            dtype = torch.float32 if self.embed.device.type == "cpu" else self.embed.dtype
            cache["keys"], cache["values"] = (
                [self.embed.new_zeros(shape, dtype=dtype) for _ in self.layers] for _ in range(2)
            )  # (R, KV, W, D) each
        for tensor in (*cache["keys"], *cache["values"]):
            tensor[:, :, self.state.prompt_width :].zero_()
        return cache["keys"], cache["values"]

    @torch.inference_mode()
    def prefill(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, state: fixed_shape.DecodeState
    ) -> torch.Tensor:
        """`LlamaDecoder.prefill` of the bucket's (R, P) padded prompts into `state`'s cache, its
        attention bias and rotations copied into the state's buffers."""
        self.state = state
        logits = super().prefill(prompt_ids, prompt_mask)  # (R, V)
        for name in ("mask", "cos", "signed_sin"):
            setattr(self, name, state.held(self, name, getattr(self, name)))
        return logits

    def eager_forward(self, token: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Feed (R,) tokens at step `t` ((1,) on the device); (R, V) float32 logits."""
        column = t + self.prompt_length  # (1,)
        cos, signed_sin = (x.index_select(1, t).squeeze(1) for x in (self.cos, self.signed_sin))  # (R, 1, D)
        mask = self.mask.masked_fill(self.state.columns > column, float("-inf"))  # (R, 1, 1, W)
        return self._forward_token(token, cos, signed_sin, mask, column)

    def _write_cache(
        self, i: int, column: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write at the (1,) `column`; attend to the whole width (the bias masks what is not written)."""
        self.keys[i].index_copy_(2, column, keys.unsqueeze(2).to(self.keys[i].dtype))
        self.values[i].index_copy_(2, column, values.unsqueeze(2).to(self.values[i].dtype))
        return self.keys[i], self.values[i]

    def weight_pointers(self) -> tuple[int, ...]:
        """Where the weights a step reads lie: a captured step must be captured again if one moved."""
        norms = [weight for layer in self.layers for weight in (layer[0], layer[3])]
        return tuple(w.data_ptr() for w in (self.embed, self.final_norm, *norms, *self.weights))


DECODERS = (
    "auto",
    "llama",
    "llama_static",
    "llama_compiled",
    "transformers",
    "transformers_static",
    "transformers_compiled",
)
LLAMA_STATIC = ("llama_static", "llama_compiled")
FORWARD_STATIC = ("transformers_static", "transformers_compiled")
STATIC_DECODERS = (*LLAMA_STATIC, *FORWARD_STATIC)
COMPILED_DECODERS = ("llama_compiled", "transformers_compiled")
FIXED_SHAPE_DECODERS = (StaticLlamaDecoder, StaticForwardDecoder)
# The decoders that multiply by a quantized model's weights (`quantization`), by rollout_quantization.
# int8: the CPU's eager ones (fbgemm's kernel is neither compiled nor captured in a CUDA graph). fp8:
# the static Llama decoders too, which round its weights again in place (a CUDA graph reads them where
# it was captured); not the static decoders of the model's own forward, whose layers round their
# weights anew into new memory.
INT8_DECODERS = ("auto", "llama", "transformers", "transformers_static")
QUANTIZED_DECODERS = {"int8": INT8_DECODERS, "int8_weight_only": INT8_DECODERS,
                      "fp8": ("auto", "llama", *LLAMA_STATIC, "transformers")}  # fmt: skip


def decoder_for(
    model: nn.Module, max_new_tokens: int, backend: str = "auto"
) -> LlamaDecoder | TransformersDecoder | StaticForwardDecoder:
    """The prefill and decoding steps for `model`, for completions of up to `max_new_tokens`.

    `backend` (`GRPOConfig.generation_backend`): 'auto' takes Llama's maths on the raw weights
    wherever they reproduce the model (`is_plain_llama`), and the model's own forward elsewhere. On
    a CUDA device it decodes in fixed shapes, each step a CUDA graph: `StaticLlamaDecoder`, or for
    other models `StaticForwardDecoder` where transformers can run their forward on a static cache
    (`static_cache_problem`), either one compiled where Triton is installed; after a failed capture
    of a model's step, no more. Elsewhere rows leave as they end (what a CPU's step costs):
    `LlamaDecoder`, `TransformersDecoder`. 'llama' / 'llama_static' / 'transformers' /
    'transformers_static' insist on one; 'llama_compiled' and 'transformers_compiled' are the
    static ones with their step compiled (`fixed_shape.compile_step`).
    """
    if backend not in DECODERS:
        raise ValueError(f"generation_backend={backend!r} is not one of {DECODERS}.")
    quantization = quantization_of(model)
    if quantization is not None and backend not in QUANTIZED_DECODERS[quantization]:
        raise ValueError(
            f"generation_backend={backend!r} does not decode rollout_quantization={quantization!r}; use one of "
            f"{QUANTIZED_DECODERS[quantization]}, or unset rollout_quantization."
        )
    plain_llama = is_plain_llama(model)
    if backend in ("llama", *LLAMA_STATIC) and not plain_llama:
        raise ValueError(
            f"generation_backend={backend!r} needs a plain LlamaForCausalLM with whole local weights, not "
            f"{type(model).__name__}; set generation_backend='auto'."
        )
    graphs = backend == "auto" and _graphs_for(model)
    fixed = backend in STATIC_DECODERS or graphs
    compiled = backend in COMPILED_DECODERS or (
        backend == "auto" and importlib.util.find_spec("triton") is not None
    )
    if not plain_llama or backend.startswith("transformers"):
        # A quantized model's layers round their weights into new memory: no CUDA graphs of its forward.
        return _forward_decoder(
            model, max_new_tokens, backend, fixed and not (graphs and quantization is not None), compiled
        )
    if fixed:
        return StaticLlamaDecoder(model, max_new_tokens, compiled=compiled)
    return LlamaDecoder(model, max_new_tokens)


def _graphs_for(model: nn.Module) -> bool:
    """Whether 'auto' decodes `model` in fixed shapes: where its steps are captured as CUDA graphs,
    unless a capture of its step failed (`fixed_shape.give_up`)."""
    device = next(model.parameters()).device
    return fixed_shape.graphs_enabled(device) and not fixed_shape.buffers_of(model).capture_failed


def _forward_decoder(
    model: nn.Module, max_new_tokens: int, backend: str, fixed: bool, compiled: bool
) -> TransformersDecoder | StaticForwardDecoder:
    """The model's own forward: in fixed shapes where asked and transformers allows it."""
    if not fixed:
        return TransformersDecoder(model)
    problem = static_cache_problem(model)
    if problem and backend in FORWARD_STATIC:
        raise ValueError(
            f"generation_backend={backend!r} cannot decode this model: {problem}; set "
            "generation_backend='transformers' (or 'auto')."
        )
    return TransformersDecoder(model) if problem else StaticForwardDecoder(model, max_new_tokens, compiled)
