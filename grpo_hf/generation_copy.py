"""A plain, low-precision copy of the policy that generation runs on.

Generation is most of GRPO's cost and needs no gradients, so it runs on a copy of the policy in
`generation_dtype` (bf16: about 2.4x faster matmuls on a CPU with AVX-512 bf16, half the memory
traffic on a GPU). With LoRA the copy holds the adapters merged into the weights (W + s * B A),
so decoding pays nothing for them; the policy itself is never merged and unmerged, so its base
weights stay bit-identical. `refresh()` writes the current policy weights into the copy once per
generation round. Only the sampling distribution is rounded: log-probs for the loss still come
from the policy, as when a separate inference engine generates.
"""

import copy

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from grpo_hf.reference import is_peft_model


class GenerationCopy:
    """The policy's weights in `dtype`, as a plain model for `rollout.generate`."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype):
        self.policy = policy
        if is_peft_model(policy):
            self.model = copy.deepcopy(policy).merge_and_unload()
            self._lora_layers = {
                name: module
                for name, module in policy.get_base_model().named_modules()
                if isinstance(module, LoraLayer)
            }
        else:
            self.model = copy.deepcopy(policy)
            self._lora_layers = {}
        self.model.to(dtype).eval().requires_grad_(False)
        self._targets = dict(self.model.named_modules())

    @torch.no_grad()
    def refresh(self) -> nn.Module:
        """Copy the policy's current weights (LoRA merged) into the copy and return it."""
        if not self._lora_layers:
            for target, source in zip(self.model.parameters(), self.policy.parameters(), strict=True):
                target.copy_(source)
            return self.model
        for name, layer in self._lora_layers.items():
            weight = layer.get_base_layer().weight
            for adapter in layer.active_adapters:
                weight = weight + layer.get_delta_weight(adapter)
            self._targets[name].weight.copy_(weight)
        return self.model
