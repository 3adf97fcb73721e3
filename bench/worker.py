"""One side of the benchmark: train our GRPOTrainer or TRL's on the shared workload; write a JSON report.

    python bench/worker.py --side ours --precision bf16 --steps 6 --output /tmp/ours.json

`--side ours-int8` is ours with `rollout_quantization='int8'` (the sampler's matmuls on int8 weights).

`bench/run.py` starts one of these per side and precision, one after the other, so each process's
peak RSS (`ru_maxrss` of RUSAGE_SELF, read at the end) is that side's alone. The workload is the
same for both: the embedded SmolLM2-135M-Instruct with LoRA r=16, alpha=32 on q/k/v/o, the
arithmetic task (a + b, a and b in 0..50) with `accuracy_reward`, G completions of each of
`prompts_per_step` prompts per optimizer step, beta > 0 (the LoRA base is the reference).

Step time is the wall time between `on_step_begin` and `on_step_end`, which brackets generation,
scoring, the reference pass, forward, backward and the optimizer step on both sides (TRL generates
in `_prepare_inputs`, inside `training_step`). TRL imports happen only when `--side trl`.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
from peft import LoraConfig
from transformers import Trainer, TrainerCallback

from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer
from grpo_hf.rewards import accuracy_reward
from grpo_hf.tasks import arithmetic_dataset

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# TRL's own profiler names its generation block "<TrainerClass>.transformers.generate" (or
# "<TrainerClass>.vLLM.generate" with use_vllm).
TRL_GENERATE_TIMER = (".transformers.generate", ".vLLM.generate")
# Our trainer's sides: the settings each adds to the shared workload's.
OUR_SIDES = {"ours": {}, "ours-int8": {"rollout_quantization": "int8"}}
SIDES = (*OUR_SIDES, "trl")


class StepTimer(TrainerCallback):
    """Wall seconds of every optimizer step, from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's settings; `bench/run.py` passes every one explicitly."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--precision", choices=("fp32", "bf16"), required=True)
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps; the first is not timed.")
    parser.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="Prompts per optimizer step.")
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default torch's.")
    parser.add_argument("--vllm", action="store_true", help="Generate with vLLM colocate (use_vllm=True).")
    parser.add_argument("--output", required=True, help="Where to write this side's JSON report.")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is a warm-up and is not timed.")
    return args


def training_settings(args: argparse.Namespace, output_dir: str) -> dict:
    """The settings both trainers' configs get, spelled out so neither side's defaults decide them.

    TRL turns gradient checkpointing on and keeps dropout by default; both are set off here, as in
    our trainer, so the two sides run the same computation.
    """
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": args.num_generations * args.prompts_per_step,  # completions
        "gradient_accumulation_steps": 1,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "beta": args.beta,
        "num_iterations": 1,
        "epsilon": 0.2,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "learning_rate": args.learning_rate,
        "max_steps": args.steps,
        "seed": args.seed,
        "bf16": args.precision == "bf16",
        "use_cpu": not torch.cuda.is_available(),
        "gradient_checkpointing": False,
        "disable_dropout": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
    } | ({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if args.vllm else {})


def build_trainer(
    args: argparse.Namespace,
    output_dir: str,
    model: torch.nn.Module | None = None,
    lora: bool = True,
    tokenizer=None,
    **overrides,
) -> tuple[Trainer, list[float]]:
    """The side's trainer on the shared workload, and a list TRL's generation timings land in.

    `model` and `tokenizer` (default: the embedded SmolLM2-135M-Instruct's), `lora=False` (full
    fine-tuning) and `overrides` of `training_settings` are for `bench/memory.py` and
    `bench/gpu_decode.py`.
    """
    model = load_model(DEFAULT_MODEL) if model is None else model
    tokenizer = load_tokenizer(DEFAULT_MODEL) if tokenizer is None else tokenizer
    dataset = arithmetic_dataset(low=0, high=50, seed=args.seed)["train"]
    peft_config = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    settings = {**training_settings(args, output_dir), **overrides}
    generate_seconds: list[float] = []
    if args.side in OUR_SIDES:
        from grpo_hf import GRPOConfig, GRPOTrainer

        settings |= OUR_SIDES[args.side]
    else:
        from trl import GRPOConfig, GRPOTrainer

        record_trl_generate_time(generate_seconds)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy_reward],
        args=GRPOConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config if lora else None,
    )
    return trainer, generate_seconds


def record_trl_generate_time(sink: list[float]) -> None:
    """Append the duration of every `model.generate` call TRL times with its own profiler to `sink`.

    TRL measures it (`profiling_context(self, "transformers.generate")`) but only sends it to
    wandb/mlflow/trackio, not to the Trainer's logs, so we listen in on the same measurement.
    """
    try:
        from trl.extras import profiling

        original = profiling.ProfilingContext._log_metrics
    except (ImportError, AttributeError):  # another TRL layout: tokens_per_second falls back to step time
        return

    def _log_metrics(self, duration: float) -> None:
        if self.name.endswith(TRL_GENERATE_TIMER):
            sink.append(duration)
        original(self, duration)

    profiling.ProfilingContext._log_metrics = _log_metrics


def per_step_logs(log_history: list[dict]) -> list[dict]:
    """The Trainer's per-step training logs (those with GRPO metrics), in step order."""
    return [entry for entry in log_history if "completions/mean_length" in entry]


def tokens_per_second(
    side: str, logs: list[dict], step_seconds: list[float], generate_seconds: list[float], completions: int
) -> tuple[list[float], str]:
    """Generation throughput per step, and how it was obtained."""
    if side in OUR_SIDES:
        return [e["generation/tokens_per_second"] for e in logs], "logged generation/tokens_per_second"
    tokens = [e["completions/mean_length"] * completions for e in logs]
    if len(generate_seconds) == len(tokens):
        return (
            [t / s for t, s in zip(tokens, generate_seconds, strict=True)],
            f"completion tokens / TRL's own '*{'|'.join(TRL_GENERATE_TIMER)}' profiling time",
        )
    return (
        [t / s for t, s in zip(tokens, step_seconds, strict=True)],
        "completion tokens / whole step time (TRL's generate timer was not seen: a lower bound)",
    )


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    completions = args.num_generations * args.prompts_per_step
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.side}-") as output_dir:
        start = time.perf_counter()
        trainer, generate_seconds = build_trainer(args, output_dir)
        setup_seconds = time.perf_counter() - start
        timer = StepTimer()
        trainer.add_callback(timer)  # last, so the other callbacks' step work is inside the window
        trainer.train()
    logs = per_step_logs(trainer.state.log_history)
    if len(logs) != len(timer.seconds):
        sys.exit(f"Expected one log per step, got {len(logs)} logs for {len(timer.seconds)} steps.")
    tps, tps_method = tokens_per_second(args.side, logs, timer.seconds, generate_seconds, completions)
    timed = slice(1, None)  # the first step warms up allocators and caches
    report = {
        "side": args.side,
        "precision": args.precision,
        "steps": len(timer.seconds),
        "step_seconds": timer.seconds,
        "median_step_seconds": statistics.median(timer.seconds[timed]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "tokens_per_second": tps,
        "median_tokens_per_second": statistics.median(tps[timed]),
        "tokens_per_second_method": tps_method,
        "generate_seconds": generate_seconds if args.side == "trl" else None,
        "completion_mean_length": [e["completions/mean_length"] for e in logs],
        "mean_completion_length": statistics.mean(e["completions/mean_length"] for e in logs[timed]),
        # Sampling differs between the sides, so completion lengths do too; this evens that out.
        "seconds_per_1k_completion_tokens": 1000
        * sum(timer.seconds[timed])
        / sum(e["completions/mean_length"] * completions for e in logs[timed]),
        "reward": [e.get("reward") for e in logs],
        "setup_seconds": setup_seconds,
        "torch_threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
