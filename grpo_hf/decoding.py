"""Decoding steps after the prompt prefill: one new token per row in, next-token logits out.

Generation is most of GRPO's cost. Through the transformers module stack a decoding step of a
small model pays for many small tensor operations per layer, a `DynamicCache` that concatenates
every layer's keys and values at every step, and (with the float32 decode attention of
`generation_copy`) a cast of the whole cache each time. For Llama-architecture models (`LlamaForCausalLM`:
SmolLM2, Llama 2/3, TinyLlama, ...) `LlamaDecoder` runs the same computation directly on the
model's weights:
- q/k/v and gate/up projections are one matmul each, on weights reordered once per generation
  round into oneDNN's blocked layout on a CPU (`BlockedLinear`);
- keys and values go into a float32 cache allocated once for the whole completion, and the
  attention of the one query token is two float32 matmuls over it;
- RMSNorm, RoPE and the residual stream round exactly where transformers' Llama does (tests
  compare logits step by step).
Any other model (GPT-2, a PEFT wrapper with unmerged adapters, sharded parameters) decodes
through `model(...)` with the prefill's `DynamicCache` (`TransformersDecoder`). On the benchmark's
shapes (SmolLM2-135M in bf16, 16 rows) a step takes 42.6 ms instead of 49.8 ms
(`bench/levers.py`, 2 CPU cores); most of what is left is reading the weights.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from grpo_hf.attention import grouped_attention


class TransformersDecoder:
    """Decoding steps through the model's own forward and the prefill's cache."""

    def __init__(
        self, model: nn.Module, cache: DynamicCache, prompt_mask: torch.Tensor, first_position: torch.Tensor
    ):
        self.model, self.cache = model, cache
        self.attention = prompt_mask  # (B, P + t)
        self.position = first_position  # (B, 1)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Feed (B,) tokens; (B, V) float32 logits for the next ones."""
        self.attention = torch.cat([self.attention, torch.ones_like(token).unsqueeze(1)], dim=1)
        out = self.model(
            input_ids=token.unsqueeze(1),
            attention_mask=self.attention,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.position = self.position + 1
        return out.logits[:, -1].float()  # (B, V)


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
        and all(type(p.data) is torch.Tensor and not hasattr(p, "ds_id") for p in model.parameters())
    )


class BlockedLinear:
    """x (rows, in) -> x @ weight.T for a fixed weight, in oneDNN's blocked layout on a CPU.

    oneDNN reorders a plain weight into its blocked layout inside every matmul; for the few rows
    of a decoding step that reorder costs as much as the product itself. Reordering once per
    generation round (`_reorder_linear_weight`, sized for `rows`) halves the step's matmul time on
    the benchmark's shapes, with bit-identical bf16 results (`bench/levers.py`). Elsewhere (a GPU,
    no oneDNN) the weight is used as it is.
    """

    def __init__(self, weight: torch.Tensor, rows: int):
        self.packed = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in float32, round to the input dtype, then scale."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, heads, D) with (B, 1, D) cos / sin, as transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _layer_weights(layer: nn.Module, rows: int) -> tuple:
    """A decoder layer's norms and matmuls in the order `LlamaDecoder` uses them, q/k/v and gate/up joined."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        layer.input_layernorm.weight,
        BlockedLinear(
            torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]), rows
        ),
        BlockedLinear(attention.o_proj.weight, rows),
        layer.post_attention_layernorm.weight,
        BlockedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), rows),
        BlockedLinear(mlp.down_proj.weight, rows),
    )


class LlamaDecoder:
    """Decoding steps of a `LlamaForCausalLM` on its weights, with a preallocated float32 KV cache."""

    def __init__(
        self,
        model: nn.Module,
        cache: DynamicCache,
        prompt_mask: torch.Tensor,
        first_position: torch.Tensor,
        max_new_tokens: int,
    ):
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        rows, prompt_length = prompt_mask.shape
        self.lm_head = BlockedLinear(model.lm_head.weight, rows)
        self.layers = [
            _layer_weights(layer, rows) for layer in model.model.layers[: config.num_hidden_layers]
        ]
        width = prompt_length + max_new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers[: len(self.layers)]:
            keys = layer.keys.new_empty((rows, self.kv_heads, width, self.head_dim), dtype=torch.float32)
            values = torch.empty_like(keys)  # (B, KV, P + N, D)
            keys[:, :, :prompt_length] = layer.keys
            values[:, :, :prompt_length] = layer.values
            self.keys.append(keys)
            self.values.append(values)
        self.mask = torch.zeros((rows, 1, 1, width), device=prompt_mask.device)  # (B, 1, 1, P + N)
        self.mask[:, 0, 0, :prompt_length].masked_fill_(prompt_mask == 0, float("-inf"))
        positions = first_position + torch.arange(max_new_tokens, device=prompt_mask.device)  # (B, N)
        cos, sin = model.model.rotary_emb(self.embed, positions)  # (B, N, D) each, in the weights' dtype
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, N, 1, D)
        self.prompt_length, self.step = prompt_length, 0

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Feed (B,) tokens; (B, V) float32 logits for the next ones."""
        rows, column = token.shape[0], self.prompt_length + self.step  # the new token's cache column
        length = column + 1  # keys attended to
        cos, sin = self.cos[:, self.step], self.sin[:, self.step]  # (B, 1, D)
        mask = self.mask[..., :length]  # (B, 1, 1, L)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        hidden = F.embedding(token, self.embed)  # (B, E)
        for i, (norm_in, qkv, out_proj, norm_post, gate_up, down) in enumerate(self.layers):
            qk, v = qkv(_rms_norm(hidden, norm_in, self.eps)).split([q_size + kv_size, kv_size], -1)
            qk = _rotate(qk.view(rows, self.heads + self.kv_heads, self.head_dim), cos, sin)  # (B, H + KV, D)
            q = qk[:, : self.heads]  # (B, H, D)
            self.keys[i][:, :, column] = qk[:, self.heads :]
            self.values[i][:, :, column] = v.view(rows, self.kv_heads, self.head_dim)
            keys, values = self.keys[i][:, :, :length], self.values[i][:, :, :length]  # (B, KV, L, D)
            attention = grouped_attention(q.unsqueeze(2), keys, values, mask).view(rows, q_size)  # (B, H * D)
            hidden = hidden + out_proj(attention)
            gate, up = gate_up(_rms_norm(hidden, norm_post, self.eps)).chunk(2, dim=-1)
            hidden = hidden + down(F.silu(gate) * up)
        self.step += 1
        return self.lm_head(_rms_norm(hidden, self.final_norm, self.eps)).float()  # (B, V)


def decoder_for(
    model: nn.Module,
    cache: DynamicCache,
    prompt_mask: torch.Tensor,
    first_position: torch.Tensor,
    max_new_tokens: int,
) -> LlamaDecoder | TransformersDecoder:
    """The decoding steps for `model` after a prefill; `first_position` (B, 1) is the first new token's."""
    if is_plain_llama(model):
        return LlamaDecoder(model, cache, prompt_mask, first_position, max_new_tokens)
    return TransformersDecoder(model, cache, prompt_mask, first_position)
