"""A plain, low-precision copy of the policy that generation runs on.

Generation is most of GRPO's cost and needs no gradients, so it runs on a copy of the policy in
`generation_dtype` (bf16: about 2.4x faster matmuls on a CPU with AVX-512 bf16, half the memory
traffic on a GPU). With LoRA the copy holds the adapters merged into the weights (W + s * B A),
so decoding pays nothing for them; the policy itself is never merged and unmerged, so its base
weights stay bit-identical. `refresh()` writes the current policy weights into the copy once per
generation round: merged LoRA layers, and every other parameter that trains (PEFT's
`modules_to_save`, such as `lm_head` or the embeddings, and biases with `bias="all"`). Only the sampling distribution is rounded: log-probs for the loss still come
from the policy, as when a separate inference engine generates. `policy_weights` is the one place
that names the policy's weights as the plain model does (LoRA merged), for this copy and for vLLM.

With `rollout_quantization` ('int8', 'int8_weight_only') the copy's matmuls take its weights
rounded to int8 (`quantization`): the sampler then differs from the policy by more than bf16's
rounding, which the sampler's log-probs record. A Llama-architecture copy decodes through `decoding.LlamaDecoder`. Other models decode through
their own forward, where the attention of one query token is `attention.grouped_attention`
(float32, no per-head copies of the cache); longer queries (the prompt prefill) go to SDPA. That
stands in for a model's attention only where SDPA computes it (`_supports_sdpa`, transformers'
own flag): Gemma 2 (logit soft-capping, which SDPA refuses) and the other models without SDPA keep
the attention they were loaded with.
"""

import copy
import re
from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from grpo_hf.engine.attention import bias_from, grouped_attention
from grpo_hf.engine.quantization import quantize_linears
from grpo_hf.models.policy import Float32Head, is_peft_model

DECODE_ATTENTION = "grpo_hf_decode"


def decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one query token over the cache in float32; anything else goes to SDPA.

    query (B, H, 1, D); key, value (B, KV, L, D) with H a multiple of KV (grouped queries);
    attention_mask a bool (B, 1, 1, L) with True where attending, or None. Returns (B, 1, H, D).
    """
    if query.shape[2] != 1 or kwargs.get("position_bias") is not None or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    bias = None if attention_mask is None else bias_from(attention_mask[:, 0])  # (B, 1, 1, L)
    return grouped_attention(query, key, value, bias, scaling).transpose(1, 2), None  # (B, 1, H, D)


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def can_decode_attention(model: nn.Module) -> bool:
    """Whether `decode_attention` (and SDPA, where it hands over) computes `model`'s attention: its
    attention layers take a registered implementation, and transformers runs it on SDPA."""
    return getattr(model, "_supports_attention_backend", False) and getattr(model, "_supports_sdpa", False)


def plain_name(name: str) -> str:
    """A PEFT base-model parameter's name in the plain model: `.base_layer` and the active
    `modules_to_save` copy unwrapped (`lm_head.modules_to_save.default.weight` -> `lm_head.weight`)."""
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name.replace(".base_layer.", "."))


def policy_weights(policy: nn.Module, trained_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as the plain model names them (what `from_pretrained` and vLLM's loader
    read), LoRA merged: W + sum over active adapters of s * B A. A tensor shared by several names
    (tied embeddings) comes once. `trained_only`: only what training can change (merged LoRA layers
    and trainable parameters); else everything, frozen originals of `modules_to_save` left out.
    Parameters must be whole (`sharding.unsharded_for_generation` around a sharded model)."""
    if not is_peft_model(policy):
        for name, param in policy.named_parameters():
            if param.requires_grad or not trained_only:
                yield name, param.detach()
        return
    base = policy.get_base_model()
    lora = {f"{name}.base_layer.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, param in base.named_parameters():
        if "lora_" in name or ".original_module." in name:
            continue
        if name in lora:
            layer, weight = lora[name], param.detach()
            for adapter in layer.active_adapters:
                weight = weight + layer.get_delta_weight(adapter)
            yield plain_name(name), weight
        elif param.requires_grad or not trained_only:
            yield plain_name(name), param.detach()


class GenerationCopy:
    """The policy's weights in `dtype`, as a plain model for `local.generate`."""

    def __init__(
        self,
        policy: nn.Module,
        dtype: torch.dtype,
        decode_attention: bool = True,
        quantization: str | None = None,
    ):
        """`decode_attention`: one query token's attention in float32 (`decode_attention`) for our
        decoding loop; False keeps the model's own (transformers' continuous batching needs it).
        `quantization` (`rollout_quantization`: 'int8', 'int8_weight_only'): the copy's matmuls take
        its weights in int8 (`quantization.quantize_linears`), rounded again after each `refresh`."""
        self.policy = policy
        self._peft = is_peft_model(policy)
        self.model = copy.deepcopy(policy).merge_and_unload() if self._peft else copy.deepcopy(policy)
        self.model.to(dtype).eval().requires_grad_(False)
        embedding = self.model.get_input_embeddings().weight
        for module in self.model.modules():  # cast_lm_head_to_fp32: an untied head's weight stays float32
            if isinstance(module, Float32Head) and module.weight is not embedding:
                module.float()
        if quantization is not None:
            quantize_linears(self.model, quantization)
        if decode_attention and can_decode_attention(self.model):
            self.model.set_attn_implementation(DECODE_ATTENTION)
        self._targets = dict(self.model.named_parameters())
        missing = [name for name, _ in policy_weights(policy, trained_only=True) if name not in self._targets]
        if self._peft and missing:
            raise ValueError(
                f"The generation copy cannot follow the trained parameter {missing[0]!r} (not in the merged "
                "model); unset generation_dtype (and --bf16) to generate from the policy itself."
            )

    @torch.no_grad()
    def refresh(self) -> nn.Module:
        """Copy the policy's current weights (LoRA merged) into the copy and return it."""
        if not self._peft:
            for target, source in zip(self.model.parameters(), self.policy.parameters(), strict=True):
                target.copy_(source)
            return self.model
        for name, weight in policy_weights(self.policy, trained_only=True):
            self._targets[name].copy_(weight)
        return self.model
