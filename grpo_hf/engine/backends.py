"""The one place a generation backend is chosen: `build_generator`, from the run's typed
`GenerationSettings` and what the device can do."""

from collections.abc import Callable

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_hf.engine.generation import GenerationSettings, Generator, Sampling
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.local import DECODER_KEYS, LocalGenerator
from grpo_hf.models.policy import is_peft_model


def local_method(settings: GenerationSettings) -> str:
    """Which local engine the settings ask for: continuous batching, transformers' generate (a cache
    implementation, or generation_kwargs our decoding loop does not implement), or our decoder."""
    if settings.use_transformers_continuous_batching:
        return "continuous_batching"
    if settings.cache_implementation is not None or set(settings.generation_kwargs) - DECODER_KEYS:
        return "generate"
    return "decoder"


def generation_copy_for(
    settings: GenerationSettings, model: nn.Module, sharded: bool, method: str
) -> GenerationCopy | None:
    """A plain copy to sample from: in generation_dtype (or bf16 under --bf16), and with LoRA or
    rollout_quantization always.

    With LoRA the copy holds the adapters merged, so a Llama decodes through `LlamaDecoder` on
    plain weights instead of the PEFT model's forward (a float32 round of the bench workload on an
    AVX2 CPU: docs/design/cpu-performance.md); it costs one more copy of the weights in that dtype
    (and with rollout_quantization their 8-bit form beside it).
    """
    copy_setting = next(
        (
            name
            for name in ("generation_dtype", "rollout_quantization")
            if getattr(settings, name) is not None
        ),
        None,
    )
    if sharded and copy_setting is not None:
        raise ValueError(
            f"{copy_setting} needs the whole model on each process; unset it under FSDP/DeepSpeed."
        )
    if sharded:
        return None
    model_dtype = next(model.parameters()).dtype
    name = settings.generation_dtype or ("bfloat16" if settings.bf16 else None)
    dtype = getattr(torch, name) if name else model_dtype
    if dtype == model_dtype and not is_peft_model(model) and settings.rollout_quantization is None:
        return None
    return GenerationCopy(
        model,
        dtype,
        decode_attention=method != "continuous_batching",
        quantization=settings.rollout_quantization,
    )


def build_generator(
    settings: GenerationSettings,
    sampling: Sampling,
    accelerator: Accelerator,
    model: nn.Module,
    policy: Callable[[], nn.Module],
    tokenizer: PreTrainedTokenizerBase,
    sharded: bool,
) -> Generator:
    """The run's generator: the one place a backend is chosen. `sampling` is what its calls will
    sample (checked here where a backend limits it), `model` the policy as built (before Accelerate
    wraps it), `policy()` the trainer's current unwrapped policy, `sharded` whether FSDP or
    DeepSpeed holds its parameters."""
    if settings.vllm is not None:
        return vllm_generator(settings, sampling, accelerator, model, policy, tokenizer)
    method = local_method(settings)
    if not settings.ds3_gather_for_generation and method != "decoder":
        raise ValueError(
            "ds3_gather_for_generation=False decodes through our decoder only; unset cache_implementation, "
            "use_transformers_continuous_batching and the generation_kwargs it does not implement "
            f"({sorted(set(settings.generation_kwargs) - DECODER_KEYS)}), or set ds3_gather_for_generation=True."
        )
    return LocalGenerator(
        accelerator,
        policy,
        generation_copy_for(settings, model, sharded, method),
        method=method,
        decoder=settings.generation_backend,
        batching_kwargs=settings.transformers_continuous_batching_config,
        sharded=sharded,
        gather=settings.ds3_gather_for_generation,
    )


def vllm_generator(
    settings: GenerationSettings,
    sampling: Sampling,
    accelerator: Accelerator,
    model: nn.Module,
    policy: Callable[[], nn.Module],
    tokenizer: PreTrainedTokenizerBase,
) -> Generator:
    """The generator vllm_mode asks for."""
    if settings.vllm.vllm_mode == "colocate":
        from grpo_hf.engine.vllm.colocate import ColocateGenerator

        return ColocateGenerator(settings, sampling, accelerator, model, policy, tokenizer)
    from grpo_hf.engine.vllm.server import ServerGenerator

    return ServerGenerator(settings, accelerator, model, policy)
