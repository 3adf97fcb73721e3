"""The one place a generation backend is chosen: `build_generator`, from the run's settings and
what the device can do; and the run's `Sampling`."""

from collections.abc import Callable

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_hf.engine.generation import Generator
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.local import DECODER_KEYS, LocalGenerator
from grpo_hf.models.policy import is_peft_model


def local_method(args) -> str:
    """Which local engine the settings ask for: continuous batching, transformers' generate (a cache
    implementation, or generation_kwargs our decoding loop does not implement), or our decoder."""
    if args.use_transformers_continuous_batching:
        return "continuous_batching"
    if args.cache_implementation is not None or set(args.generation_kwargs) - DECODER_KEYS:
        return "generate"
    return "decoder"


def generation_copy_for(args, model: nn.Module, sharded: bool, method: str) -> GenerationCopy | None:
    """A plain copy to sample from: in generation_dtype (or bf16 under --bf16), and with LoRA always.

    With LoRA the copy holds the adapters merged, so a Llama decodes through `LlamaDecoder` on
    plain weights instead of the PEFT model's forward (a float32 round of the bench workload on an
    AVX2 CPU: see README); it costs one more copy of the weights in that dtype.
    """
    if sharded and args.generation_dtype is not None:
        raise ValueError(
            "generation_dtype needs the whole model on each process; unset it under FSDP/DeepSpeed."
        )
    if sharded:
        return None
    model_dtype = next(model.parameters()).dtype
    name = args.generation_dtype or ("bfloat16" if args.bf16 else None)
    dtype = getattr(torch, name) if name else model_dtype
    if dtype == model_dtype and not is_peft_model(model):
        return None
    return GenerationCopy(model, dtype, decode_attention=method != "continuous_batching")


def build_generator(
    args,
    accelerator: Accelerator,
    model: nn.Module,
    policy: Callable[[], nn.Module],
    tokenizer: PreTrainedTokenizerBase,
    sharded: bool,
) -> Generator:
    """The run's generator: the one place a backend is chosen. `model` is the policy as built (before
    Accelerate wraps it), `policy()` the trainer's current unwrapped policy, `sharded` whether FSDP
    or DeepSpeed holds its parameters."""
    if args.generation_backend == "vllm":
        return vllm_generator(args, accelerator, model, policy, tokenizer)
    method = local_method(args)
    if not args.ds3_gather_for_generation and method != "decoder":
        raise ValueError(
            "ds3_gather_for_generation=False decodes through our decoder only; unset cache_implementation, "
            "use_transformers_continuous_batching and the generation_kwargs it does not implement "
            f"({sorted(set(args.generation_kwargs) - DECODER_KEYS)}), or set ds3_gather_for_generation=True."
        )
    return LocalGenerator(
        accelerator,
        policy,
        generation_copy_for(args, model, sharded, method),
        method=method,
        decoder=args.generation_backend,
        batching_kwargs=args.transformers_continuous_batching_config,
        sharded=sharded,
        gather=args.ds3_gather_for_generation,
    )


def vllm_generator(
    args,
    accelerator: Accelerator,
    model: nn.Module,
    policy: Callable[[], nn.Module],
    tokenizer: PreTrainedTokenizerBase,
) -> Generator:
    """The generator vllm_mode asks for."""
    if args.vllm_mode == "colocate":
        from grpo_hf.engine.vllm.colocate import ColocateGenerator

        return ColocateGenerator(args, accelerator, model, policy, tokenizer)
    from grpo_hf.engine.vllm.server import ServerGenerator

    return ServerGenerator(args, accelerator, model, policy)
