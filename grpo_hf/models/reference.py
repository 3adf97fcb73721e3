"""The one place that decides what the KL reference is, and how it moves.

- beta = 0: no reference at all (nothing loaded, no reference pass).
- A user-given `ref_model`: used as is, frozen (it may differ from the policy's starting point,
  as in seed 003, but must share its tokenizer).
- A PEFT policy: the base model with the adapters disabled. No second copy of the weights exists.
- Otherwise: a frozen deep copy of the policy at the start of training.

`load_reference` is the trainer's entry: a reference given by name is loaded as the policy was,
and the reference is placed like the policy (`sharding.prepare_reference`).

`sync_ref_model` moves a copied reference towards the policy every `ref_model_sync_steps`
optimizer steps: ref <- alpha * policy + (1 - alpha) * ref (TR-DPO, arXiv 2404.09656; the
`ReferenceSync` callback).
"""

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel, TrainerCallback

from grpo_hf.models.loading import load_model
from grpo_hf.models.policy import cast_lm_head_to_fp32, is_peft_model, reference_init_kwargs
from grpo_hf.models.sharding import parameters_for_mixing, prepare_reference, zero3_partitioned

logger = logging.getLogger(__name__)


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


def load_reference(
    accelerator: Accelerator,
    policy: nn.Module,
    args,
    ref_model: str | PreTrainedModel | None,
    lora: bool,
    init_kwargs: dict,
) -> nn.Module | None:
    """The frozen reference of a `GRPOConfig` run (None when beta = 0 or with LoRA), prepared like
    the policy; one loaded by name as the policy was (`models.reference_init_kwargs`)."""
    if ref_model is None and args.beta > 0 and not lora and zero3_partitioned(policy) and policy.name_or_path:
        # ZeRO-3 partitioned the policy as it loaded (zero.Init): load the reference the same way.
        logger.info(
            "ZeRO-3: loading the reference from %s instead of copying the policy.", policy.name_or_path
        )
        ref_model = policy.name_or_path
    if isinstance(ref_model, str):
        unwrapped = accelerator.unwrap_model(policy)
        ref_model = load_model(ref_model, **reference_init_kwargs(args, init_kwargs, unwrapped))
    if ref_model is not None and args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(ref_model)
    reference = build_reference(policy, args.beta, ref_model)
    return None if reference is None else prepare_reference(accelerator, reference, policy)


class ReferenceSync(TrainerCallback):
    """After every `ref_model_sync_steps`-th optimizer step with `sync_ref_model`: mix the policy
    (`policy()`, the trainer's current model) into the reference (TR-DPO)."""

    def __init__(
        self, accelerator: Accelerator, policy: Callable[[], nn.Module], ref_model: nn.Module | None
    ):
        self.accelerator, self.policy, self.ref_model = accelerator, policy, ref_model

    def on_step_end(self, args, state, control, **kwargs):
        if args.sync_ref_model and state.global_step % args.ref_model_sync_steps == 0:
            ref = self.accelerator.unwrap_model(self.ref_model)
            policy = self.accelerator.unwrap_model(self.policy())
            with parameters_for_mixing(self.accelerator, ref, policy):
                mix_into_reference(ref, policy, args.ref_model_mixup_alpha)
