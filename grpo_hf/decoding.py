"""Decoding steps after the prompt prefill: one new token per row in, next-token logits out.

Generation is most of GRPO's cost. Through the transformers module stack a decoding step of a
small model pays for many small tensor operations per layer, a `DynamicCache` that concatenates
every layer's keys and values at every step, and (with the float32 decode attention of
`generation_copy`) a cast of the whole cache each time. For Llama-architecture models (`LlamaForCausalLM`:
SmolLM2, Llama 2/3, TinyLlama, ...) `LlamaDecoder` runs the same computation directly on the
model's weights:
- q/k/v and gate/up projections are one matmul each (`join_projections` makes them adjacent in
  memory, so the joined weight is a view, not a copy);
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


def _joined(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights stacked by rows: a view if they already lie one after another in memory."""
    first = weights[0]
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for weight in weights:
        if (
            weight.untyped_storage().data_ptr() != storage  # side by side by chance is not enough
            or not weight.is_contiguous()
            or weight.data_ptr() != end
            or weight.dtype != first.dtype
        ):
            return torch.cat(weights)
        end += weight.numel() * weight.element_size()
    rows = sum(weight.shape[0] for weight in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


@torch.no_grad()
def join_projections(model: nn.Module) -> None:
    """Store each layer's q/k/v and gate/up weights one after another (rows of one tensor).

    The modules keep working as before; `LlamaDecoder` then runs each group as one matmul without
    copying. For a model that only ever decodes (the bf16 generation copy), done once.
    """
    for layer in model.model.layers:
        for modules in (
            [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
            [layer.mlp.gate_proj, layer.mlp.up_proj],
        ):
            storage = torch.cat([module.weight for module in modules])  # (sum of out, in)
            start = 0
            for module in modules:
                rows = module.weight.shape[0]
                module.weight = nn.Parameter(storage[start : start + rows], requires_grad=False)
                start += rows


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


def _layer_weights(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    """A decoder layer's weights in the order `LlamaDecoder` uses them, q/k/v and gate/up joined."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        layer.input_layernorm.weight,
        _joined([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
        attention.o_proj.weight,
        layer.post_attention_layernorm.weight,
        _joined([mlp.gate_proj.weight, mlp.up_proj.weight]),
        mlp.down_proj.weight,
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
        self.lm_head = model.lm_head.weight
        self.layers = [_layer_weights(layer) for layer in model.model.layers[: config.num_hidden_layers]]
        rows, prompt_length = prompt_mask.shape
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
            qk, v = F.linear(_rms_norm(hidden, norm_in, self.eps), qkv).split([q_size + kv_size, kv_size], -1)
            qk = _rotate(qk.view(rows, self.heads + self.kv_heads, self.head_dim), cos, sin)  # (B, H + KV, D)
            q = qk[:, : self.heads]  # (B, H, D)
            self.keys[i][:, :, column] = qk[:, self.heads :]
            self.values[i][:, :, column] = v.view(rows, self.kv_heads, self.head_dim)
            keys, values = self.keys[i][:, :, :length], self.values[i][:, :, :length]  # (B, KV, L, D)
            grouped = q.reshape(rows, self.kv_heads, -1, self.head_dim).float()  # (B, KV, H / KV, D)
            scores = grouped @ keys.transpose(-1, -2) * self.head_dim**-0.5 + mask  # (B, KV, H / KV, L)
            attention = (scores.softmax(dim=-1) @ values).to(hidden.dtype).view(rows, q_size)  # (B, H * D)
            hidden = hidden + F.linear(attention, out_proj)
            gate, up = F.linear(_rms_norm(hidden, norm_post, self.eps), gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, down)
        self.step += 1
        return F.linear(_rms_norm(hidden, self.final_norm, self.eps), self.lm_head).float()  # (B, V)


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
