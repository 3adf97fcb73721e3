"""Peak memory of a GRPO training step, ours and TRL's, as completions grow (issue 13).

    python bench/memory.py                      # ours and TRL, 256 / 1024 / 2048 / 4096 tokens
    python bench/memory.py --sides ours --lengths 256,1024 --checkpointing off,on

Every (side, length, gradient checkpointing) trains `--steps` optimizer step(s) in a fresh
subprocess (`--worker`), one after the other. The model has SmolLM2-135M-Instruct's shape and
tokenizer with random weights (`AutoModelForCausalLM.from_config` on its config, seed 0): random
weights almost never sample EOS (about 1 in 49k tokens), so completions run to
`--max-completion-length`; each report carries the mean completion length to show it. The rest of
the workload is `bench/worker.py`'s (LoRA r=16 on q/k/v/o unless `--full`, arithmetic prompts,
beta 0.04, the reference pass included), with `--prompts-per-step` x `--num-generations`
completions per step (2 x 2 by default, so a CPU run ends in minutes).

Peak memory: on CUDA `torch.cuda.max_memory_allocated` over the last step (statistics reset at its
start); on a CPU the peak RSS of the worker process (`ru_maxrss`), which includes loading the
model. Results go to bench/results/<date>-memory-<machine>.json. TRL is needed only for `--sides trl`
(`pip install -e ".[bench]"`).

    python bench/memory.py --saved-per-layer 1024,2048   # a minute or two per length on a CPU

prints instead what one decoder layer of our padding-free policy pass saves for backward, with
each attention (`packing.uses_causal_rows` forced either way): SmolLM2-135M's layer shape (LoRA
r=16 on q/k/v/o) with a 4096-token vocabulary, 2 prompts x 2 completions (one ending a quarter
early), the difference between a 2-layer and a 1-layer model (`tests/test_memory.saved_bytes`).
"""

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import results_path  # noqa: E402
from run import machine_info, rerun_command, run_worker  # noqa: E402
from worker import StepTimer, build_trainer, per_step_logs  # noqa: E402

from grpo_hf.models.loading import DEFAULT_MODEL, resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class LastStepPeak(TrainerCallback):
    """CUDA: the most memory allocated during the last step (statistics reset at every step's start)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="ours,trl", help="Comma-separated: ours, trl.")
    parser.add_argument(
        "--lengths", default="256,1024,2048,4096", help="Completion lengths, comma-separated."
    )
    parser.add_argument("--checkpointing", default="off,on", help="Gradient checkpointing: off, on, or both.")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--full", action="store_true", help="Full fine-tuning instead of LoRA.")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds before a worker is stopped.")
    parser.add_argument("--output", default=str(results_path("memory")))
    parser.add_argument(
        "--saved-per-layer", default="", help="Completion lengths: print bytes saved per layer."
    )
    # One configuration in this process (what the driver starts):
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--max-completion-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.lengths = [int(n) for n in args.lengths.split(",") if n]
    args.checkpointing = [c == "on" for c in args.checkpointing.split(",") if c]
    return args


def random_model() -> torch.nn.Module:
    """SmolLM2-135M-Instruct's architecture with random weights (seed 0), float32."""
    config = AutoConfig.from_pretrained(resolve_model_path(DEFAULT_MODEL))  # no weights loaded
    config.max_position_embeddings = max(config.max_position_embeddings, 8192)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def worker(args: argparse.Namespace) -> None:
    """Train one configuration; write its report to `args.output`."""
    # The fields `worker.training_settings` reads.
    settings = argparse.Namespace(
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        max_completion_length=args.max_completion_length,
        beta=0.04,
        learning_rate=1e-4,
        steps=args.steps,
        seed=0,
        precision=args.precision,
        side=args.side,
        vllm=False,
    )
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix=f"memory-{args.side}-") as output_dir:
        trainer, _ = build_trainer(
            settings,
            output_dir,
            model=random_model(),
            lora=not args.full,
            use_cpu=not cuda,
            gradient_checkpointing=args.gradient_checkpointing,
            logging_steps=1,
        )
        timer, peak = StepTimer(), LastStepPeak()
        trainer.add_callback(peak)
        trainer.add_callback(timer)
        trainer.train()
    logs = per_step_logs(trainer.state.log_history)
    report = {
        "side": args.side,
        "max_completion_length": args.max_completion_length,
        "gradient_checkpointing": args.gradient_checkpointing,
        "full_fine_tuning": args.full,
        "precision": args.precision,
        "completions_per_step": args.num_generations * args.prompts_per_step,
        "mean_completion_length": statistics.mean(e["completions/mean_length"] for e in logs),
        "step_seconds": timer.seconds,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cuda_peak_allocated_mb": peak.peak_bytes / 2**20 if peak.peak_bytes is not None else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }
    Path(args.output).write_text(json.dumps(report, indent=1))


def saved_per_layer(lengths: list[int]) -> None:
    """Print the bytes one layer of a policy pass saves for backward, per attention and length."""
    sys.path.insert(0, str(ROOT / "tests"))
    from peft import LoraConfig, get_peft_model
    from test_memory import saved_bytes

    from grpo_hf.engine import packing

    def build(layers: int) -> torch.nn.Module:
        config = AutoConfig.from_pretrained(resolve_model_path(DEFAULT_MODEL))
        config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = layers, 4096, 8192
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        return get_peft_model(model, lora).eval()

    for length in lengths:
        for attention, limit in (("causal rows (SDPA)", -1), ("grouped_attention", 10**15)):
            packing.GROUPED_MAX_SCORES = limit
            one, two = (saved_bytes(build(layers), length) for layers in (1, 2))
            print(f"{length} tokens, {attention}: {(two - one) / 2**20:.1f} MB per layer", flush=True)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.saved_per_layer:
        saved_per_layer([int(n) for n in args.saved_per_layer.split(",")])
        return
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    results, start = [], time.time()
    for length in args.lengths:
        for checkpointing in args.checkpointing:
            for side in args.sides:
                name = f"{side}-{length}-{'gc' if checkpointing else 'nogc'}"
                result_path = output.parent / f"memory-{name}.json"
                command = [
                    sys.executable, str(Path(__file__).resolve()), "--worker", "--side", side,
                    "--max-completion-length", str(length), "--precision", args.precision,
                    "--steps", str(args.steps), "--num-generations", str(args.num_generations),
                    "--prompts-per-step", str(args.prompts_per_step), "--output", str(result_path),
                ] + (["--gradient-checkpointing"] if checkpointing else []) + (["--full"] if args.full else [])  # fmt: skip
                result = run_worker(command, output.parent / f"memory-{name}.log", result_path, args.timeout)
                results.append({"name": name, **result})
                peak = result.get("cuda_peak_allocated_mb") or result.get("peak_rss_mb")
                print(
                    f"{name}: {'error ' + result['error'] if 'error' in result else f'{peak:.0f} MB'}",
                    flush=True,
                )
                output.write_text(
                    json.dumps(
                        {"command": rerun_command(), "machine": machine_info(), "seconds": time.time() - start,
                         "results": results},
                        indent=1,
                    )
                )  # fmt: skip


if __name__ == "__main__":
    main()
