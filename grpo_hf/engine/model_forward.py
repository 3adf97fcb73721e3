"""Decoding through the model's own forward, for every architecture `decoding.LlamaDecoder` does not
reproduce (GPT-2, Qwen2, a Llama with biases, a PEFT wrapper, sharded weights, ...).

`TransformersDecoder` is our shrinking loop's: a `DynamicCache`, rows leaving as they end. On a GPU
its step is as much kernel launches and Python as Llama's was (issue 30), so `StaticForwardDecoder`
runs the same forward in `fixed_shape`'s loop: each distinct prompt prefilled once through a
`DynamicCache`, its keys and values copied into the bucket's `StaticCache`; then one token per row
and step at fixed shapes, the cache's length (its next column) held on the device, replayed as a
CUDA graph on a GPU, of the model's eager kernels or (`compiled`) of inductor's fused ones.

Which models: those transformers itself runs in one graph on a static cache
(`_can_compile_fullgraph`, the claim its compiled `generate` rests on), with whole local weights
and only full-attention cache layers (`static_cache_problem`). Sliding-window layers keep a ring
buffer whose writes depend on a Python counter, so those models stay with `TransformersDecoder`.
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from grpo_hf.engine import fixed_shape
from grpo_hf.engine.logprobs import cache_keyword, position_ids_from_mask, prefill_prompts


class TransformersDecoder:
    """Prefill and decoding steps through the model's own forward and a `DynamicCache`."""

    def __init__(self, model: nn.Module):
        self.model, self.cache_keyword = model, cache_keyword(model)

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Run the (B, P) left-padded prompts (each distinct one once); (B, V) float32 next-token logits."""
        logits, self.cache = prefill_prompts(self.model, prompt_ids, prompt_mask)
        self.attention = prompt_mask  # (B, P + t)
        self.position = position_ids_from_mask(prompt_mask)[:, -1:] + 1  # (B, 1)
        return logits.float()

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Feed (B,) tokens; (B, V) float32 logits for the next ones."""
        self.attention = torch.cat([self.attention, torch.ones_like(token).unsqueeze(1)], dim=1)
        out = self.model(
            input_ids=token.unsqueeze(1),
            attention_mask=self.attention,
            position_ids=self.position,
            use_cache=True,
            **{self.cache_keyword: self.cache},
        )
        self.position = self.position + 1
        return out.logits[:, -1].float()  # (B, V)

    def keep(self, rows: torch.Tensor) -> None:
        """Go on decoding only `rows` (indices into the current rows), in that order."""
        self.cache.reorder_cache(rows)
        self.attention, self.position = self.attention[rows], self.position[rows]


def whole_local_weights(model: nn.Module) -> bool:
    """Every parameter a plain tensor on this process (not DeepSpeed-partitioned, not quantized)."""
    return all(type(p.data) is torch.Tensor and not hasattr(p, "ds_id") for p in model.parameters())


def static_cache_problem(model: nn.Module) -> str | None:
    """Why `StaticForwardDecoder` cannot decode `model`, or None where it can."""
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        return f"{name} is not a transformers model (a PEFT wrapper with unmerged adapters?)"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not run {name} in one graph on a static cache (_can_compile_fullgraph)"
    if not whole_local_weights(model):
        return f"{name}'s weights are partitioned or quantized"
    layers = StaticCache(config=model.config, max_cache_len=1).layers
    if any(type(layer) is not StaticLayer for layer in layers):
        return f"{name} has sliding-window or other non-static cache layers"
    return None


class StaticForwardDecoder:
    """The model's own forward in `fixed_shape`'s buffers: prefill, `eager_forward(token, t)`, and
    where the weights a captured step reads lie. `fixed_shape.decode` drives it, through
    `torch.compile` where `compiled`."""

    CAPTURE_FALLBACK = (
        "set generation_backend='transformers_static' to decode without torch.compile, "
        "or 'transformers' without CUDA graphs"
    )

    def __init__(self, model: nn.Module, max_new_tokens: int, compiled: bool = False):
        self.model, self.max_new_tokens = model, fixed_shape.bucket(max_new_tokens)
        self.compiled = compiled  # the step through torch.compile (`fixed_shape.compile_step`)
        self.cache_keyword = cache_keyword(model)
        self.vocab = model.get_output_embeddings().weight.shape[0]

    def prefill(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, state: fixed_shape.DecodeState
    ) -> torch.Tensor:
        """The bucket's (R, P) padded prompts, each distinct one run once; their keys and values go
        into `state`'s static cache. (R, V) float32 next-token logits."""
        logits, prompt_cache = prefill_prompts(self.model, prompt_ids, prompt_mask)  # (R, V)
        buffers = state.own(self)
        if "cache" not in buffers:
            width = state.prompt_width + state.new_tokens
            buffers["cache"] = StaticCache(config=self.model.config, max_cache_len=width)
        self.cache = buffers["cache"]
        self.cache.reset()  # in place: zeros, and each layer's length back to 0
        prompt_columns = {"cache_position": torch.arange(prompt_ids.shape[1], device=prompt_ids.device)}
        for i, layer in enumerate(prompt_cache.layers):  # written at columns 0..P-1, lengths now P
            self.cache.update(layer.keys, layer.values, i, prompt_columns)
        visible = F.pad(prompt_mask, (0, state.new_tokens), value=1)  # (R, P + N)
        first = position_ids_from_mask(prompt_mask)[:, -1:] + 1  # (R, 1)
        positions = first + torch.arange(state.new_tokens, device=first.device)  # (R, N)
        self.mask = state.held(self, "mask", visible)
        self.positions, self.prompt_width = state.held(self, "positions", positions), prompt_ids.shape[1]
        return logits.float()

    def eager_forward(self, token: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Feed (R,) tokens at step `t` ((1,) on the device); (R, V) float32 logits. Each cache
        layer writes at its length, a device tensor its update advances: set to column P + t here,
        so steps run before a capture (its warm-up) leave no trace."""
        column = t.squeeze(0) + self.prompt_width  # () P + t
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(column)
        out = self.model(
            input_ids=token.unsqueeze(1),
            attention_mask=self.mask,  # (R, P + N): prompt padding; columns past P + t are causal-masked
            position_ids=self.positions.index_select(1, t),  # (R, 1)
            use_cache=True,
            **{self.cache_keyword: self.cache},
        )
        return out.logits[:, -1].float()  # (R, V)

    def weight_pointers(self) -> tuple[int, ...]:
        """Where the parameters and buffers a step reads lie (captured again if one moved)."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return tuple(tensor.data_ptr() for tensor in tensors)
