"""FSDP2 placement for the parts of GRPO that the Trainer does not shard itself.

- `prepare_reference`: a frozen reference placed like the policy (sharded under FSDP2).
- `unsharded_for_generation`: whole parameters while decoding, so processes that stop at
  different steps issue no mismatched collectives.
- `reshard`: every FSDP2 group back to its shard (before mixing a reference into the policy).
Without FSDP each is a no-op or the plain Accelerate call.
"""

import contextlib
from collections.abc import Iterator

from accelerate import Accelerator
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch import nn
from torch.distributed.fsdp import FSDPModule


def prepare_reference(accelerator: Accelerator, ref: nn.Module, policy: nn.Module) -> nn.Module:
    """Place the frozen reference like the policy.

    `prepare_model(evaluation_mode=True)` leaves a model untouched under FSDP: on the CPU,
    unsharded, where a GPU run would fail and `sync_ref_model` would mix plain tensors into the
    policy's DTensor shards. Under FSDP2 the reference is sharded like the policy instead.
    """
    if getattr(accelerator.state, "fsdp_plugin", None) is None:
        return accelerator.prepare_model(ref, evaluation_mode=True)
    if not accelerator.is_fsdp2:
        return ref.to(accelerator.device)  # FSDP1: a whole frozen copy on each device
    # Wrap by the policy's layer classes, also for a user-given reference of another class.
    accelerator.state.fsdp_plugin.set_auto_wrap_policy(policy)
    return fsdp2_prepare_model(accelerator, ref)


@contextlib.contextmanager
def unsharded_for_generation(model: nn.Module, accelerator: Accelerator) -> Iterator[None]:
    """Under FSDP2, all-gather the parameters once and keep them whole while decoding.

    Decoding calls the model once per token and each process stops when its own rows are done.
    With FSDP2's per-forward all-gathers, processes stopping at different steps would issue
    mismatched collectives (a crash or a hang); with whole parameters decoding needs none, and
    saves an all-gather per token, at the cost of holding the whole model during generation.
    Afterwards every group reshards after forward as configured, except the root (False, as FSDP
    sets it): accelerate's lm_head / norm group, which it kept whole, is regathered in backward.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if accelerator.is_fsdp2 else []
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        reshard = bool(accelerator.state.fsdp_plugin.reshard_after_forward) if modules else False
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(reshard and module is not model, recurse=False)


def reshard(*models: nn.Module) -> None:
    """Return every FSDP2 group of `models` to its shard.

    FSDP2 leaves groups built with reshard_after_forward=False (accelerate's lm_head / norm group)
    whole after a no-grad forward; parameter-wise arithmetic between two models must see shards.
    """
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
