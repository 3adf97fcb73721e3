"""FSDP2 and DeepSpeed ZeRO-3 placement for the parts of GRPO that the Trainer does not shard itself.

- `prepare_reference`: a frozen reference placed like the policy (sharded under FSDP2 and ZeRO-3).
- `unsharded_for_generation`: whole parameters while decoding, so processes that stop at
  different steps issue no mismatched collectives; or, under ZeRO-3 with
  `ds3_gather_for_generation=False`, partitioned parameters and decoding in lockstep.
- `parameters_for_mixing`: the policy and reference parameters in a form that parameter-wise
  arithmetic (`sync_ref_model`) can use: matching shards under FSDP2, gathered under ZeRO-3.
Without FSDP or ZeRO-3 each is the plain Accelerate call or does nothing.
"""

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch import nn
from torch.distributed.fsdp import FSDPModule


def prepare_reference(accelerator: Accelerator, ref: nn.Module, policy: nn.Module) -> nn.Module:
    """Place the frozen reference like the policy.

    `prepare_model(evaluation_mode=True)` leaves a model untouched under FSDP: on the CPU,
    unsharded, where a GPU run would fail and `sync_ref_model` would mix plain tensors into the
    policy's DTensor shards. Under FSDP2 the reference is sharded like the policy instead; under
    ZeRO-3 it becomes a DeepSpeed inference engine with its parameters partitioned (ZeRO-2 shards
    no parameters, so there it is a whole frozen copy, as under DDP).
    """
    if _zero_stage(accelerator) == 3:
        return _zero3_inference_engine(accelerator, ref)
    if getattr(accelerator.state, "fsdp_plugin", None) is None:
        return accelerator.prepare_model(ref, evaluation_mode=True)
    if not accelerator.is_fsdp2:
        return ref.to(accelerator.device)  # FSDP1: a whole frozen copy on each device
    # Wrap by the policy's layer classes, also for a user-given reference of another class.
    accelerator.state.fsdp_plugin.set_auto_wrap_policy(policy)
    return fsdp2_prepare_model(accelerator, ref)


@contextlib.contextmanager
def unsharded_for_generation(
    model: nn.Module, accelerator: Accelerator | None = None, gather: bool = True
) -> Iterator[Callable[[bool], bool] | None]:
    """All-gather the parameters once and keep them whole while decoding. Every process enters.

    Decoding calls the model once per token and each process stops when its own rows are done.
    With per-forward all-gathers (FSDP2, ZeRO-3), processes stopping at different steps would
    issue mismatched collectives (a crash or a hang); with whole parameters decoding needs none,
    and saves an all-gather per token, at the cost of holding the whole model during generation.
    Without an accelerator (before training), only a model partitioned at load by ZeRO-3 is gathered.

    `gather=False` (`ds3_gather_for_generation`) under ZeRO-3 leaves the parameters partitioned:
    each layer is gathered at each forward, so no process holds the whole model. Then it yields
    `all_done(done) -> bool`, which decoding calls once per step on every process (an all-reduce)
    and stops only when every process is done: the processes decode in lockstep. Otherwise None.
    """
    engine = None if accelerator is None else _zero3_engine(accelerator)
    if engine is not None and not gather:
        yield _lockstep(accelerator)
    elif engine is not None:
        with _whole_zero3_parameters(engine):
            yield
    elif zero3_partitioned(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # no engine: no hooks either
            yield
    elif accelerator is not None and accelerator.is_fsdp2:
        with _whole_fsdp2_parameters(model, accelerator):
            yield
    else:
        yield


@contextlib.contextmanager
def parameters_for_mixing(accelerator: Accelerator, ref: nn.Module, policy: nn.Module) -> Iterator[None]:
    """Inside, `ref` and `policy` parameters can be combined element-wise; changes to `ref` persist.

    FSDP2 leaves groups built with reshard_after_forward=False (accelerate's lm_head / norm group)
    whole after a no-grad forward: every group goes back to its shard, and shards are mixed with
    shards. Under ZeRO-3 both are gathered, and what process 0 writes is partitioned back.
    """
    if _zero_stage(accelerator) == 3:
        import deepspeed

        params = [*ref.parameters(), *policy.parameters()]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            yield
        return
    for model in (ref, policy):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    yield


def _lockstep(accelerator: Accelerator) -> Callable[[bool], bool]:
    """`all_done(done)`: whether every process says it is done (every process calls it, once per step)."""

    def all_done(done: bool) -> bool:
        going = torch.tensor([0.0 if done else 1.0], device=accelerator.device)  # (1,)
        return accelerator.reduce(going, "sum").item() == 0

    return all_done


# ---- FSDP2 ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _whole_fsdp2_parameters(model: nn.Module, accelerator: Accelerator) -> Iterator[None]:
    """Every FSDP2 group unsharded until exit.

    Afterwards every group reshards after forward as configured, except the root (False, as FSDP
    sets it): accelerate's lm_head / norm group, which it kept whole, is regathered in backward.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        reshard = bool(accelerator.state.fsdp_plugin.reshard_after_forward)
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(reshard and module is not model, recurse=False)


# ---- DeepSpeed ZeRO-3 -----------------------------------------------------------------------------


def zero3_partitioned(model: nn.Module) -> bool:
    """The model's parameters are ZeRO-3 partitions (from zero.Init at load, or a ZeRO-3 engine)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _zero_stage(accelerator: Accelerator) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else plugin.zero_stage


def _zero3_engine(accelerator: Accelerator):
    """The policy's DeepSpeed engine under ZeRO-3, once `train()` has built it; else None."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return wrapped.engine if wrapped is not None and _zero_stage(accelerator) == 3 else None


@contextlib.contextmanager
def _whole_zero3_parameters(engine) -> Iterator[None]:
    """Every parameter gathered, and ZeRO-3's per-module hooks off, until exit.

    The hooks would re-partition a module's parameters after its forward and gather them again
    (collectively) at the next one; without them the gathered parameters stay in place.
    """
    import deepspeed

    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        offload._remove_module_hooks()
        try:
            yield
        finally:
            offload.setup_zero_stage3_hooks()


def _zero3_inference_engine(accelerator: Accelerator, ref: nn.Module) -> nn.Module:
    """`ref` as a ZeRO-3 engine without optimizer: partitioned like the policy, gathered per forward.

    The config is the run's own DeepSpeed config minus optimizer and scheduler; entries still
    "auto" (sizes the Trainer fills in from the policy later) are left to DeepSpeed's defaults.
    """
    import deepspeed

    config = _without_auto(copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config))
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=ref, config=config)
    engine.eval()
    return engine


def _without_auto(config: dict) -> dict:
    return {
        key: _without_auto(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if value != "auto"
    }
