"""The one place that decides what the KL reference is, and how it moves.

- beta = 0: no reference at all (nothing loaded, no reference pass).
- A user-given `ref_model`: used as is, frozen (it may differ from the policy's starting point,
  as in seed 003, but must share its tokenizer).
- A PEFT policy: the base model with the adapters disabled. No second copy of the weights exists.
- Otherwise: a frozen deep copy of the policy at the start of training.

`sync_ref_model` moves a copied reference towards the policy every `ref_model_sync_steps`
optimizer steps: ref <- alpha * policy + (1 - alpha) * ref (TR-DPO, arXiv 2404.09656).
"""

import contextlib
import copy
from collections.abc import Iterator

import torch
from peft import PeftModel
from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    """True for a model wrapped by PEFT (LoRA and friends)."""
    return isinstance(model, PeftModel)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` in eval mode with no parameter requiring grad."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3 partitions: nothing to copy
        raise ValueError(
            "The policy was partitioned by DeepSpeed ZeRO-3 as it loaded, and a partitioned model cannot be "
            "copied into a reference: pass ref_model= (a model id or path), pass the policy by id or path "
            "(the reference is then loaded the same way), or use peft_config (the base model is the reference)."
        )
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def build_reference(policy: nn.Module, beta: float, ref_model: nn.Module | None) -> nn.Module | None:
    """The separate reference module, or None (no KL term, or the PEFT base serves as reference)."""
    if beta == 0.0:
        return None
    if ref_model is not None:
        ref_model.eval()
        ref_model.requires_grad_(False)
        return ref_model
    if is_peft_model(policy):
        return None
    return frozen_copy(policy)


@contextlib.contextmanager
def reference_context(policy: nn.Module, ref_model: nn.Module | None) -> Iterator[nn.Module]:
    """Yield the module whose forward gives reference log-probs."""
    if ref_model is not None:
        yield ref_model
    elif is_peft_model(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise ValueError("No reference model: beta = 0 computes no reference log-probs.")


@torch.no_grad()
def mix_into_reference(ref_model: nn.Module, policy: nn.Module, alpha: float) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter."""
    for ref_param, param in zip(ref_model.parameters(), policy.parameters(), strict=True):
        ref_param.mul_(1.0 - alpha).add_(param.detach().to(ref_param.dtype), alpha=alpha)
