"""How far vLLM's sampler log-probs are from our log-prob pass, per precision, and what the
importance-sampling bounds do with the gap.

    python bench/precision_gap.py --precision bf16      # vLLM in bf16 (emulated on a CPU without it)
    python bench/precision_gap.py --precision fp32

Run it with the vLLM environment's Python (`make bench-precision` runs both). One colocated vLLM
engine in `--precision` samples `--prompts` x `--num-generations` completions (temperature 1, no
truncation) of SmolLM2-135M-Instruct with a non-zero LoRA adapter, prompts asking for a worked
answer so completions run long; then our log-prob pass scores the same tokens in float32 and under
bf16 autocast (as the trainer computes old log-probs with --bf16). For each pass it reports, over
completion tokens, |log pi_sampler - log pi_ours| (mean, 99th percentile, max) and its mean signed
value (log pi_ours - log pi_sampler: negative on average, the sampler's own tokens being likelier
under itself), and over completions the sequence log-ratio (the sum over its tokens) and the share
of completions that TRL's default correction (`vllm_importance_sampling_mode='sequence_mask'`,
`clip_max=3.0`) would drop (ratio > 3) or that a `clip_min` of 1/3 would drop (ratio < 1/3).
"""

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from vllm_backend import machine, policy

from grpo_hf import GRPOConfig
from grpo_hf.data import rollout
from grpo_hf.engine.backends import build_generator
from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.models.loading import DEFAULT_MODEL, load_tokenizer
from grpo_hf.tasks import arithmetic_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from results_file import results_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASK = " Explain each step of the sum before you give the result."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("bf16", "fp32"), required=True, help="vLLM's dtype.")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument(
        "--output",
        default=None,
        help="JSON report (default bench/results/<date>-precision_<p>-<machine>.json).",
    )
    return parser.parse_args(argv)


def sample(args: argparse.Namespace, model: torch.nn.Module, output_dir: str) -> rollout.Rollout:
    """vLLM's completions of the prompts, with its sampler log-probs."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    config = GRPOConfig(
        output_dir=output_dir, use_cpu=True, report_to=[], precision=args.precision,
        max_completion_length=args.max_new_tokens, num_generations=args.num_generations,
        per_device_train_batch_size=args.prompts * args.num_generations, use_vllm=True,
        vllm_kv_cache_memory_bytes=512 * 2**20, vllm_max_model_length=1024, vllm_enforce_eager=True,
    )  # fmt: skip
    sampling = config.sampling(rollout.eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    generator = build_generator(
        config.generation_settings(),
        sampling,
        Accelerator(cpu=True),
        model,
        lambda: model,
        tokenizer,
        sharded=False,
    )
    generator.load_policy(0)
    rows = arithmetic_dataset(num_train=args.prompts, num_test=1)["train"]
    texts = [
        rollout.render_prompt(tokenizer, [{"role": "user", "content": row["prompt"][-1]["content"] + ASK}])
        for row in rows
        for _ in range(args.num_generations)
    ]
    ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, torch.device("cpu"))
    return generator.generate(ids, mask, sampling, policy_version=0)


def gaps(ours: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict:
    """The token and sequence figures of log pi_ours - log pi_sampler over the completion tokens."""
    active = mask.bool()  # (B, C)
    diff = (ours - sampler).masked_fill(~active, 0.0)  # (B, C)
    tokens = diff[active]
    sequence = diff.sum(dim=1)  # (B,) log of the sequence's importance ratio
    return {
        "token_abs_mean": round(tokens.abs().mean().item(), 4),
        "token_abs_p99": round(tokens.abs().quantile(0.99).item(), 4),
        "token_abs_max": round(tokens.abs().max().item(), 4),
        "token_signed_mean": round(tokens.mean().item(), 5),
        "sequence_log_ratio_min": round(sequence.min().item(), 3),
        "sequence_log_ratio_median": round(sequence.median().item(), 3),
        "sequence_log_ratio_max": round(sequence.max().item(), 3),
        "dropped_by_clip_max_3": round((sequence > math.log(3.0)).float().mean().item(), 3),
        "dropped_by_clip_min_one_third": round((sequence < -math.log(3.0)).float().mean().item(), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = policy()
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as output_dir:
        result = sample(args, model, output_dir)
    width = result.completion_ids.shape[1]
    passes = {}
    with torch.no_grad():
        for name, dtype in (("ours_fp32", None), ("ours_bf16_autocast", torch.bfloat16)):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                ours, _, _ = completion_logps(model, result.input_ids, result.attention_mask, width, 1.0)
            passes[name] = gaps(ours.float(), result.sampler_logps, result.completion_mask)
    lengths = result.completion_mask.sum(dim=1).float()
    report = {
        "machine": machine(),
        "settings": vars(args),
        "completion_tokens": {"mean": lengths.mean().item(), "max": lengths.max().item()},
        f"vllm_{args.precision}_against": passes,
    }
    for name, figures in passes.items():
        print(f"vLLM {args.precision} vs {name}:", figures, flush=True)
    output = Path(args.output or results_path(f"precision_{args.precision}"))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
