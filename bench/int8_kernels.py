"""The int8 matmul paths PyTorch (and torchao, where installed) offer on a CPU, against the float
ones decoding runs today, on a decoding step's shapes: what `engine.quantization` was chosen from.

    python bench/int8_kernels.py            # a few minutes; writes bench/results/<date>-int8_kernels-<machine>.json
    python bench/int8_kernels.py --repeats 400 --threads 2

Shapes (rows x in -> out, SmolLM2-135M at decoding's 16 rows): the LM head 16 x 576 -> 49,152,
the MLP's gate/up 16 x 576 -> 3,072 and down 16 x 1,536 -> 576, and a prefill's gate/up
(464 x 576 -> 3,072: 16 prompts of 29 tokens). Paths, each x (rows, in) -> (rows, out):
- `float32`, `bf16`: `F.linear` on the plain weight (float32 is what an AVX2 CPU decodes in);
- `bf16 blocked`: oneDNN on the weight reordered once (`cpu.BlockedLinear`: decoding today on a
  CPU with AVX-512-BF16; on an AVX2 CPU the bf16 reorder is refused and this row is absent);
- `int8 dynamic (fbgemm)`: `quantization.Int8Matmul`, PyTorch's dynamic int8 linear
  (`torch.ops.quantized.linear_dynamic`: activations rounded per call, per-channel int8 weights);
- `int8 _int_mm`: activations rounded per row in Python, `torch._int_mm` (int8 x int8 -> int32),
  both scales applied after;
- `int8 weight-only (bf16)`: `aten._weight_int8pack_mm`, bf16 activations on int8 weights;
- `torchao int8 dynamic`: torchao's `quantize_(..., Int8DynamicActivationInt8WeightConfig())`,
  where torchao imports.
The paths alternate within each repeat; each figure is the median (and the minimum, the least
disturbed run on a shared machine) of its repeats, in ms per call.

Then what each `rollout_quantization` does to the sampler (`sampler_kl`): the default model
(float32, as the policy) and its generation copy (bf16 where this CPU multiplies bf16 natively, else
float32; then int8, int8_weight_only or fp8 on top, fp8 emulated: the GPU kernel's maths) decode the
same 24 tokens after the same prompts (16 rows: 2 arithmetic prompts x 8, tokens drawn from the
policy), and the mean per-token
KL(policy || copy) of the next-token distributions is printed, prefill's first token apart; then
the same with 'int8' on one kind of matmul only (`INT8_ONLY`: q/k/v, o, gate/up, down, the LM head,
and o + gate/up + LM head), the others as the bf16 copy: where the int8 sampler's error comes from.
"""

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo_hf.engine.cpu import BlockedLinear, blocked_matmul_supported, native_bf16
from grpo_hf.engine.decoding import LlamaDecoder
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.quantization import (
    ROLLOUT_QUANTIZATIONS,
    Int8Matmul,
    full_range_activations,
    int8_kernel_supported,
    quantize_linears,
    quantize_per_channel,
)
from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer

SHAPES = {
    "LM head 16x576->49152": (16, 576, 49152),
    "gate/up 16x576->3072": (16, 576, 3072),
    "down 16x1536->576": (16, 1536, 576),
    "prefill gate/up 464x576->3072": (464, 576, 3072),
}
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from results_file import results_path  # noqa: E402
from run import machine_info  # noqa: E402

OUTPUT = results_path("int8_kernels")


def int_mm_path(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ W.T through `torch._int_mm`, activations rounded per row."""
    q, scale = quantize_per_channel(weight)
    qt = q.t()  # (in, out)

    def run(x: torch.Tensor) -> torch.Tensor:
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # (rows, 1)
        xq = torch.round(x / x_scale).to(torch.int8)  # (rows, in)
        return torch._int_mm(xq, qt).float() * x_scale * scale  # (rows, out)

    return run


def torchao_path(weight: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchao's int8 dynamic-activation, int8-weight linear, or None where torchao does not import."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        return None
    layer = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)).to(dtype)
    layer[0].weight.data.copy_(weight)
    quantize_(layer, Int8DynamicActivationInt8WeightConfig())
    return lambda x: layer(x.to(dtype))


def paths(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every path that runs here, as x (float32) -> x @ W.T."""
    bf16 = weight.bfloat16()
    q, scale = quantize_per_channel(weight)
    found = {
        "float32": lambda x: F.linear(x, weight),
        "bf16": lambda x: F.linear(x.bfloat16(), bf16),
        "int8 _int_mm": int_mm_path(weight),
        "int8 weight-only (bf16)": lambda x: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), q, scale.bfloat16()
        ),
    }
    if blocked_matmul_supported(torch.bfloat16):
        blocked = BlockedLinear(bf16, rows)
        found["bf16 blocked"] = lambda x: blocked(x.bfloat16())
    if int8_kernel_supported():
        found["int8 dynamic (fbgemm)"] = Int8Matmul(weight)
    ao = torchao_path(weight, torch.bfloat16)
    if ao is not None:
        found["torchao int8 dynamic"] = ao
    return found


def measure(shape: tuple[int, int, int], repeats: int) -> dict[str, dict[str, float]]:
    rows, width, out = shape
    weight, x = torch.randn(out, width) * 0.02, torch.randn(rows, width)
    runs = paths(weight, rows)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():  # warm-up
            run(x)
        for i in range(repeats):
            for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                start = time.perf_counter()
                runs[name](x)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t)} for name, t in times.items()}


# The three matmuls whose activations round with the least error on SmolLM2 (`sampler_kl`).
TAME_INT8 = ("o_proj", "gate_proj", "up_proj", "lm_head")
# Llama's matmuls by what they multiply (`_matmul_weights`' groups): each alone in int8, then the
# tame three together.
INT8_ONLY = {
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate/up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    "LM head": ("lm_head",),
    "o, gate/up, LM head": TAME_INT8,
}


def sampler_copies(model: torch.nn.Module, dtype: torch.dtype):
    """(name, model) of each sampler compared: the generation copy in `dtype` as each
    `rollout_quantization` makes it, then with 'int8' on one kind of matmul only (`INT8_ONLY`)."""
    for kind in (None, *ROLLOUT_QUANTIZATIONS):
        yield (
            f"{dtype} copy" + (f", {kind}" if kind else ""),
            GenerationCopy(model, dtype, quantization=kind).model,
        )
    for name, layers in INT8_ONLY.items():
        copy = GenerationCopy(model, dtype).model
        yield f"{dtype} copy, int8 on {name} only", quantize_linears(copy, "int8", only=layers)


@torch.no_grad()
def sampler_kl(steps: int = 24) -> dict[str, dict[str, float]]:
    """Per-token KL(policy || sampler) of each generation copy's next-token distributions: at the first
    new token (after the prompt's prefill) and the mean over the decoding steps after it."""
    model = load_model(DEFAULT_MODEL).eval().requires_grad_(False)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 35), (7, 44))]
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    ids, mask = (encoded[key].repeat_interleave(8, dim=0) for key in ("input_ids", "attention_mask"))
    dtype = torch.bfloat16 if native_bf16() else torch.float32
    results = {}
    for name, copy in sampler_copies(model, dtype):
        torch.manual_seed(0)
        policy, sampler = LlamaDecoder(model, steps), LlamaDecoder(copy, steps)
        expected, got = policy.prefill(ids, mask), sampler.prefill(ids, mask)
        kls = []
        for _ in range(steps):
            p, q = torch.log_softmax(expected, dim=-1), torch.log_softmax(got, dim=-1)  # (16, V)
            kls.append((p.exp() * (p - q)).sum(dim=-1).mean().item())
            token = torch.multinomial(p.exp(), 1).squeeze(1)  # (16,)
            expected, got = policy(token), sampler(token)
        results[name] = {
            "first_token_kl": kls[0],
            "decoding_kl": statistics.mean(kls[1:]),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=UserWarning)  # quantized tensors' deprecation notices
    results = {name: measure(shape, args.repeats) for name, shape in SHAPES.items()}
    for name, figures in results.items():
        print(name)
        for path, figure in sorted(figures.items(), key=lambda item: item[1]["median_ms"]):
            print(f"  {path:26s} median {figure['median_ms']:8.3f} ms   min {figure['min_ms']:8.3f} ms")
    results["sampler_kl"] = sampler_kl()
    print("KL(policy || sampler) per token, the default model (float32 policy):")
    for name, kl in results["sampler_kl"].items():
        print(f"  {name:56s} first token {kl['first_token_kl']:.4f}   decoding {kl['decoding_kl']:.4f}")
    results["threads"] = args.threads
    results["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    results["vnni"] = torch.cpu._is_vnni_supported()
    results["full_range_activations"] = full_range_activations()
    results["machine"] = machine_info()
    results["torch"] = torch.__version__
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(results, indent=1))
    print(f"Results: {OUTPUT}")


if __name__ == "__main__":
    main()
