"""The engine: everything that makes a rollout or a log-prob pass fast, apart from the algorithm.

The trainer asks for "completions of these prompts" (`rollout` -> `decoding.decoder_for`, the one
place a decoder is chosen) and "log-probs of these tokens" (`logprobs.completion_logps`); it never
knows which path answered. Modules:

- `decoding`: prompt prefill and decoding steps; `decoder_for` picks `LlamaDecoder` (Llama's maths
  on the raw weights), `StaticLlamaDecoder` (the same in fixed shapes, CUDA graphs on a GPU) or
  one of `model_forward`'s;
- `model_forward`: the model's own forward, any architecture: `TransformersDecoder` (a
  `DynamicCache`, rows leaving as they end) and `StaticForwardDecoder` (fixed shapes on a
  `StaticCache`, CUDA graphs on a GPU, where transformers can compile the model whole);
- `fixed_shape`: shape buckets, the static buffers and the CUDA graph capture of a decoding step;
- `cpu`: what this CPU computes natively, and oneDNN's blocked-weight matmul with its fallback;
- `generation_copy`: the low-precision, LoRA-merged copy generation samples from;
- `quantization`: that copy's matmuls on int8 weights (`rollout_quantization`);
- `logprobs`, `packing`, `attention`, `token_scores`: the padding-free loss passes and the chunked
  log-softmax.
"""

import torch

from grpo_hf.engine import cpu


def native_bf16(use_cpu: bool) -> tuple[bool, str]:
    """Whether the training device multiplies bf16 natively, and a line saying so, for precision='auto'.

    A CUDA GPU with bf16 (Ampere and later); a CPU with AVX-512-BF16 or AMX. Elsewhere (AVX2-only
    x86, ARM, older GPUs) bf16 matmuls are emulated and slower than float32.
    """
    if not use_cpu and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"precision: bf16, {name} computes bf16 natively"
        return False, f"precision: fp32, {name} has no native bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    said = "" if cpu.forced_bf16() is None else f" ({cpu.CPU_BF16_VARIABLE} says so)"
    if cpu.native_bf16():
        return True, f"precision: bf16, this CPU ({capability}) has AVX-512-BF16 or AMX{said}"
    return False, f"precision: fp32, this CPU ({capability}) has no native bf16{said}"


def precision_line(precision: str | None, bf16: bool, use_cpu: bool) -> str | None:
    """The line to log at start: the precision precision='auto' chose, or that an explicit --bf16 is
    emulated here; None when there is nothing to say."""
    native, line = native_bf16(use_cpu)
    if precision == "auto":
        return line
    if bf16 and not native:
        return (
            f"--bf16 is set but bf16 is not native here ({line.split(', ', 1)[1]}): its matmuls are emulated, "
            "several times slower than float32. Set precision='auto' (or drop --bf16) to train in float32."
        )
    return None
