"""What single speed levers give, each against the plain way, on the benchmark's shapes.

    python bench/levers.py            # about a minute; writes bench/results/<date>-levers-<machine>.json
    python bench/levers.py --only int8     # the levers whose name has "int8"; <date>-levers-int8-<machine>.json

Everything runs in bf16 where this CPU multiplies it natively (AVX-512-BF16 or AMX) and in float32
elsewhere, as the trainer's precision='auto' would; "bf16" below reads "float32" there.

- sampling: `local.sample_tokens` (inverse CDF, one uniform per row) against
  `torch.multinomial(softmax)`, 16 rows of the default model's 49k vocabulary, ms per call;
- decoding step: `decoding.LlamaDecoder` against the model's own forward (`TransformersDecoder`)
  on the bf16 generation copy of the default model, 16 rows (2 prompts x 8) after a 29-token
  prompt, ms per step;
- decoding, finished rows out: the decoding steps of a round whose completions end as
  `completion_lengths` says (half at 48 tokens, half at 12 to 45), each row leaving the decoder
  after its last token (`LlamaDecoder.keep`, as `local.generate` runs it) against every row
  decoded to the end, s per round;
- decoding matmuls: every matmul of a decoding step (30 layers and the LM head, 16 rows) on
  weights reordered once into oneDNN's blocked layout (`decoding.BlockedLinear`) against
  `F.linear` on the plain bf16 weights, ms per step;
- loss pass, shared prompts: `logprobs.completion_logits` forward + backward with each distinct
  prompt run once (its KV cache shared by its 8 completions) against every row whole, LoRA r=16
  on q/k/v/o, bf16 autocast, 16 rows of 29 + 48 tokens, s per pass;
- loss pass, padding-free: `logprobs.packed_completion_logps` (only real completion tokens through
  the model) against the padded pass with shared prompts (`completion_logits` and
  `token_logps_and_entropy`), forward + backward, same model; completions of 48 tokens in half
  the rows and 12 to 45 in the others (mean 38, as in the benchmark's rounds), s per pass;
- attention in that pass: `attention.grouped_attention` (query heads grouped) against SDPA
  (`F.scaled_dot_product_attention` with `enable_gqa`, the math kernel on these short batches),
  same packed pass, s per pass;
- fused LM head: the same packed pass with the frozen LM head fused into the log-softmax
  (`logprobs._ScoringHead`) against the model's own head and `token_logps_and_entropy`, the model
  prepared as the trainer runs it (Accelerate bf16: autocast, outputs cast to float32), s per pass;
- decoding step, int8 copy: `decoding.LlamaDecoder` on the generation copy with
  `rollout_quantization='int8'` (int8 weights, `engine.quantization`) against the same copy in
  bf16, 16 rows after a 29-token prompt, ms per step;
- decoding step, int8 o/gate/up/head: the same with int8 on the o, gate/up and LM head matmuls only
  (`TAME_INT8`: those whose activations round with the least error on SmolLM2, `bench/int8_kernels.py`),
  q/k/v and down as in the bf16 copy;
- reference passes, token budget: a round's no-grad log-prob pass (the reference's; the old
  log-probs' is the same) of the 16 rows of `completion_lengths`, LoRA policy, under a
  `token_budget` of the whole round (one pass: each prompt prefilled once for its 8 rows) against
  one pass per micro-batch of 4 rows (per_device_train_batch_size=4, gradient_accumulation_steps=4),
  s per round.
The padding-free and attention levers run both sides with the model's own head.
The two sides of a lever alternate (A, B, B, A, ...), so a machine whose speed drifts favours
neither; each figure is the median of its repeats.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model

from grpo_hf.data.token_budget import budget_passes, rows_in_passes
from grpo_hf.engine import logprobs, packing
from grpo_hf.engine.attention import grouped_attention
from grpo_hf.engine.cpu import BlockedLinear, native_bf16
from grpo_hf.engine.decoding import LlamaDecoder
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.local import sample_tokens
from grpo_hf.engine.logprobs import (
    attention_kernel,
    completion_logits,
    packed_completion_logps,
)
from grpo_hf.engine.model_forward import TransformersDecoder
from grpo_hf.engine.quantization import quantize_linears
from grpo_hf.engine.token_scores import token_logps_and_entropy
from grpo_hf.models.loading import DEFAULT_MODEL, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from int8_kernels import TAME_INT8  # noqa: E402
from results_file import results_path  # noqa: E402
from run import machine_info  # noqa: E402

ROWS, GROUP, PROMPT, COMPLETION = 16, 8, 29, 48
# The precision the trainer's precision='auto' takes here: bf16 only on a CPU that multiplies it natively.
DTYPE = torch.bfloat16 if native_bf16() else torch.float32
OUTPUT = results_path("levers")


def alternate(a: Callable[[], float], b: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Medians of `repeats` timings of each, taken in the order a, b, b, a, a, b, ..."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            times[side].append((a, b)[side]())
    return statistics.median(times[0]), statistics.median(times[1])


def seconds(run: Callable[[], object], calls: int = 1) -> float:
    """Wall seconds per call of `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def sampling_lever(vocab: int) -> tuple[float, float]:
    scores = torch.randn(ROWS, vocab) * 3  # (B, V)
    multinomial = lambda: torch.multinomial(torch.softmax(scores, dim=-1), 1)  # noqa: E731
    ours = lambda: sample_tokens(scores)  # noqa: E731
    return alternate(lambda: seconds(ours, 20) * 1e3, lambda: seconds(multinomial, 20) * 1e3, 6)


@torch.no_grad()
def decoding_lever(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    copy = GenerationCopy(model, DTYPE).refresh()
    token = torch.randint(0, copy.config.vocab_size, (ROWS,))

    def per_step(kind: type) -> float:
        decoder = kind(copy, COMPLETION) if kind is LlamaDecoder else kind(copy)
        decoder.prefill(ids, mask)
        return seconds(lambda: decoder(token), COMPLETION - 1) * 1e3

    return alternate(lambda: per_step(LlamaDecoder), lambda: per_step(TransformersDecoder), 4)


@torch.no_grad()
def finished_rows_lever(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    copy = GenerationCopy(model, DTYPE).refresh()
    lengths, token = completion_lengths(), torch.randint(0, copy.config.vocab_size, (ROWS,))

    def round_seconds(drop: bool) -> float:
        decoder = LlamaDecoder(copy, COMPLETION)
        decoder.prefill(ids, mask)
        going = torch.arange(ROWS)  # the decoder's rows
        start = time.perf_counter()
        for step in range(1, COMPLETION):  # the logits of token `step`, for rows longer than that
            if drop and (lengths[going] <= step).any():
                open_rows = (lengths[going] > step).nonzero().squeeze(1)
                decoder.keep(open_rows)
                going = going[open_rows]
            decoder(token[going])
        return time.perf_counter() - start

    return alternate(lambda: round_seconds(True), lambda: round_seconds(False), 4)


@torch.no_grad()
def matmul_lever(model: torch.nn.Module) -> tuple[float, float]:
    copy = GenerationCopy(model, DTYPE).refresh()
    weights = [module.weight for module in copy.modules() if isinstance(module, torch.nn.Linear)]
    inputs = [torch.randn(ROWS, weight.shape[1], dtype=DTYPE) for weight in weights]
    blocked = [BlockedLinear(weight, ROWS) for weight in weights]

    def ours() -> None:
        for linear, x in zip(blocked, inputs, strict=True):
            linear(x)

    def plain() -> None:
        for weight, x in zip(weights, inputs, strict=True):
            torch.nn.functional.linear(x, weight)

    return alternate(lambda: seconds(ours, 10) * 1e3, lambda: seconds(plain, 10) * 1e3, 6)


def lora_policy(model: torch.nn.Module) -> torch.nn.Module:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))


def fwd_bwd_seconds(run: Callable[[], torch.Tensor]) -> float:
    """Seconds of one forward (under bf16 autocast where bf16 is native) and the backward of its scalar."""

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=DTYPE == torch.bfloat16):
            scalar = run()
        scalar.backward()

    return seconds(step)


def shared_prompts_lever(
    policy: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float]:
    completions = torch.randint(0, policy.config.vocab_size, (ROWS, COMPLETION))
    input_ids = torch.cat([ids, completions], dim=1)  # (B, P + C)
    attention = torch.ones_like(input_ids)

    def run(share: bool) -> torch.Tensor:
        logits = completion_logits(policy, input_ids, attention, COMPLETION, share_prompts=share)
        return logits.float().logsumexp(dim=-1).sum()

    return alternate(
        lambda: fwd_bwd_seconds(lambda: run(True)), lambda: fwd_bwd_seconds(lambda: run(False)), 6
    )


def completion_lengths() -> torch.Tensor:
    """(B,) lengths as in the benchmark's rounds: 8 completions of 48 tokens, 8 of 12 to 45 (mean 38)."""
    return torch.cat([torch.full((ROWS // 2,), COMPLETION), torch.linspace(12, 45, ROWS // 2).round().long()])


def bench_completions(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P + C) ids and attention mask, completions of `completion_lengths`."""
    real = (torch.arange(COMPLETION) < completion_lengths().unsqueeze(1)).long()  # (B, C)
    completions = torch.randint(0, vocab, (ROWS, COMPLETION)) * real
    return torch.cat([ids, completions], dim=1), torch.cat([mask, real], dim=1)


@contextlib.contextmanager
def unfused_head() -> Iterator[None]:
    """Packed passes with the model's own LM head, then `token_logps_and_entropy` on its logits."""
    fused = logprobs.scoring_head
    logprobs.scoring_head = lambda model: None
    try:
        yield
    finally:
        logprobs.scoring_head = fused


def padding_free_lever(policy: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    input_ids, attention = bench_completions(ids, mask, policy.config.vocab_size)
    completions, real = input_ids[:, -COMPLETION:], attention[:, -COMPLETION:]

    def packed() -> torch.Tensor:
        with unfused_head():
            return packed_completion_logps(policy, input_ids, attention, COMPLETION)[0].sum()

    def padded() -> torch.Tensor:
        with attention_kernel(input_ids):  # as `completion_logps` runs it
            logits = completion_logits(policy, input_ids, attention, COMPLETION)  # (B, C, V)
        return (token_logps_and_entropy(logits, completions)[0] * real).sum()

    return alternate(lambda: fwd_bwd_seconds(packed), lambda: fwd_bwd_seconds(padded), 6)


def sdpa(query, key, value, bias, scale=None, dropout=0.0) -> torch.Tensor:
    """`grouped_attention`'s contract through PyTorch's SDPA."""
    return F.scaled_dot_product_attention(
        query, key, value, bias, dropout, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )


def attention_lever(policy: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    input_ids, attention = bench_completions(ids, mask, policy.config.vocab_size)

    def run(kernel: Callable) -> float:
        packing.grouped_attention = kernel
        try:
            with attention_kernel(input_ids), unfused_head():
                return fwd_bwd_seconds(
                    lambda: packed_completion_logps(policy, input_ids, attention, COMPLETION)[0].sum()
                )
        finally:
            packing.grouped_attention = grouped_attention

    return alternate(lambda: run(grouped_attention), lambda: run(sdpa), 6)


def fused_head_lever(policy: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    input_ids, attention = bench_completions(ids, mask, policy.config.vocab_size)
    accelerator = Accelerator(mixed_precision="bf16" if DTYPE == torch.bfloat16 else "no", cpu=True)
    model = accelerator.prepare_model(policy)  # wraps policy.forward: autocast, float32 outputs

    def run(fused: bool) -> float:
        with attention_kernel(input_ids), contextlib.nullcontext() if fused else unfused_head():
            return fwd_bwd_seconds(
                lambda: packed_completion_logps(model, input_ids, attention, COMPLETION)[0].sum()
            )

    try:
        return alternate(lambda: run(True), lambda: run(False), 6)
    finally:
        accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # policy.forward as it was


@torch.no_grad()
def int8_decoding_lever(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, only: tuple[str, ...] | None = None
) -> tuple[float, float]:
    int8 = quantize_linears(GenerationCopy(model, DTYPE).refresh(), "int8", only=only)
    copies = {"int8": int8, None: GenerationCopy(model, DTYPE).refresh()}
    token = torch.randint(0, model.config.vocab_size, (ROWS,))

    def per_step(kind: str | None) -> float:
        decoder = LlamaDecoder(copies[kind], COMPLETION)
        decoder.prefill(ids, mask)
        return seconds(lambda: decoder(token), COMPLETION - 1) * 1e3

    return alternate(lambda: per_step("int8"), lambda: per_step(None), 4)


@torch.no_grad()
def token_budget_lever(policy: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    input_ids, attention = bench_completions(ids, mask, policy.config.vocab_size)
    tokens = attention.sum(dim=1).tolist()  # (B,) prompt + completion tokens of each row

    def round_seconds(passes: list[slice]) -> float:
        def run() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=DTYPE == torch.bfloat16):
                for rows in passes:
                    logprobs.completion_logps(policy, input_ids[rows], attention[rows], COMPLETION)

        return seconds(run)

    budgeted = rows_in_passes(tokens, budget_passes(tokens, sum(tokens)))  # a budget of the whole round
    micro_batches = [slice(start, start + ROWS // 4) for start in range(0, ROWS, ROWS // 4)]
    return alternate(lambda: round_seconds(budgeted), lambda: round_seconds(micro_batches), 6)


def levers(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[str, str, Callable]]:
    """(name, unit, run) of every lever; `run()` gives (ours, plain)."""
    policy = {}  # the LoRA policy, made on first use: it adds LoRA layers to `model` itself

    def lora() -> torch.nn.Module:
        return policy.setdefault("model", lora_policy(model))

    return [
        ("sampling (16 x vocab)", "ms", lambda: sampling_lever(model.config.vocab_size)),
        ("decoding step (bf16 copy)", "ms", lambda: decoding_lever(model, ids, mask)),
        ("decoding, finished rows out", "s", lambda: finished_rows_lever(model, ids, mask)),
        ("decoding matmuls (16 rows)", "ms", lambda: matmul_lever(model)),
        ("decoding step, int8 copy", "ms", lambda: int8_decoding_lever(model, ids, mask)),
        (
            "decoding step, int8 o/gate/up/head",
            "ms",
            lambda: int8_decoding_lever(model, ids, mask, TAME_INT8),
        ),
        ("loss pass, shared prompts", "s", lambda: shared_prompts_lever(lora(), ids, mask)),
        ("loss pass, padding-free", "s", lambda: padding_free_lever(lora(), ids, mask)),
        ("packed pass attention", "s", lambda: attention_lever(lora(), ids, mask)),
        ("loss pass, fused LM head", "s", lambda: fused_head_lever(lora(), ids, mask)),
        ("reference passes, token budget", "s", lambda: token_budget_lever(lora(), ids, mask)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the levers whose name contains this text")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(DEFAULT_MODEL).eval()
    ids = torch.randint(0, model.config.vocab_size, (ROWS // GROUP, PROMPT)).repeat_interleave(GROUP, dim=0)
    mask = torch.ones_like(ids)  # (B, P): 2 prompts, each repeated 8 times
    results = {}
    for name, unit, run in levers(model, ids, mask):  # in order: the LoRA levers after the plain ones
        if args.only not in name:
            continue
        ours, plain = run()
        results[name] = {"ours": ours, "plain": plain, "unit": unit, "speedup": plain / ours}
        print(f"{name:32s} ours {ours:8.3f} {unit}   plain {plain:8.3f} {unit}   {plain / ours:5.2f}x")
    results["threads"] = torch.get_num_threads()
    results["dtype"] = str(DTYPE)
    results["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    results["machine"] = machine_info()
    output = results_path(f"levers-{args.only.replace(' ', '_')}") if args.only else OUTPUT
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    print(f"Results: {output}")


if __name__ == "__main__":
    main()
