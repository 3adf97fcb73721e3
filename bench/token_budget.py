"""Our GRPO step with and without `token_budget`, on 1 and 2 processes: what cutting the log-prob passes
by tokens, and dealing the rows to processes by tokens, does to a step's time and memory.

    python bench/token_budget.py                              # about 10 minutes; bench/results/<date>-token_budget-<machine>.json
    python bench/token_budget.py --processes 2 --budget 1024 --steps 4

The workload is `make bench`'s (`bench/worker.py`: SmolLM2-135M-Instruct, LoRA, the arithmetic task, 8
completions of each of 2 prompts per optimizer step, beta > 0), its completions of mixed lengths as
sampled (those that end before `--max-completion-length` and those cut there), in
`--accumulation` micro-batches per optimizer step, split over the processes: one pass per
micro-batch without a budget, passes of at most `--budget` tokens with it. Two processes run over
gloo (`recipes/accelerate/cpu_ddp2.yaml`), one thread each; one process runs with `--threads`
threads. Each configuration trains in its own launch, one after the other, the configurations in
turn `--rounds` times (every other round in reverse order); a step's time is the main process's
(its median over the steps after the first of each run), peak RSS the main process's.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker  # noqa: E402  (bench/worker.py, beside this file)
from results_file import results_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = results_path("token_budget")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts to run")
    parser.add_argument("--budget", type=int, default=512, help="token_budget of the budgeted runs")
    parser.add_argument(
        "--steps", type=int, default=5, help="optimizer steps per run; the first is not timed"
    )
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--max-completion-length", type=int, default=96)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a one-process run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--worker", type=Path, default=None, help=argparse.SUPPRESS
    )  # a launched run's report
    parser.add_argument("--run-budget", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is a warm-up and is not timed.")
    return args


def overrides(args: argparse.Namespace, processes: int, budget: int | None) -> dict:
    """The run's GRPOConfig settings on top of the workload's: its micro-batches, and the budget."""
    completions = 16  # per optimizer step: 8 completions of 2 prompts, as bench/worker.py
    per_device = completions // (processes * args.accumulation)
    if per_device < 1 or per_device * processes * args.accumulation != completions:
        raise ValueError(
            f"{completions} completions per step do not split into {processes} x {args.accumulation}"
        )
    return {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": args.accumulation,
        "token_budget": budget,
    }


def run_worker(args: argparse.Namespace) -> None:
    """One launched configuration: train, then the main process writes its step times and RSS."""
    base = worker.parse_args(["--side", "ours", "--precision", args.precision, "--steps", str(args.steps),
                        "--max-completion-length", str(args.max_completion_length), "--output", str(args.worker)])  # fmt: skip
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory(prefix="bench-token-budget-") as output_dir:
        trainer, _ = worker.build_trainer(base, output_dir, **overrides(args, processes, args.run_budget))
        timer = worker.StepTimer()
        trainer.add_callback(timer)
        trainer.train()
    if trainer.accelerator.is_main_process:
        lengths = [
            e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e
        ]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        report = {"step_seconds": timer.seconds, "mean_completion_length": lengths, "processes": processes,
                  "peak_rss_mb": rss}  # fmt: skip
        args.worker.write_text(json.dumps(report))


def launch(args: argparse.Namespace, processes: int, budget: int | None, report: Path) -> dict:
    """One configuration in its own launch (`accelerate launch` for 2 processes); its report."""
    flags = ["--worker", str(report), "--steps", str(args.steps), "--accumulation", str(args.accumulation),
             "--max-completion-length", str(args.max_completion_length), "--precision", args.precision]  # fmt: skip
    flags += ["--run-budget", str(budget)] if budget is not None else []
    if processes == 1:
        command = [sys.executable, str(Path(__file__).resolve()), *flags]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "recipes" / "accelerate" / "cpu_ddp2.yaml"), "--num_processes", str(processes),
                   "--num_cpu_threads_per_process", "1", str(Path(__file__).resolve()), *flags]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
    env |= {"WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return json.loads(report.read_text())


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        run_worker(args)
        return
    configurations = [(p, b) for p in args.processes for b in (None, args.budget)]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for processes, budget in configurations if r % 2 == 0 else configurations[::-1]:
                key = f"{processes}p_{'budget' if budget else 'micro-batches'}"
                print(f"[token_budget] {key} (round {r + 1})", flush=True)
                start = time.perf_counter()
                report = launch(args, processes, budget, Path(folder) / f"{key}-{r}.json")
                runs.setdefault(key, []).append(report | {"wall_seconds": time.perf_counter() - start})
    results = {}
    for key, reports in runs.items():
        timed = [s for report in reports for s in report["step_seconds"][1:]]
        results[key] = {"median_step_seconds": statistics.median(timed), "timed_step_seconds": timed,
                        "peak_rss_mb": max(report["peak_rss_mb"] for report in reports), "runs": reports}  # fmt: skip
        print(f"{key:22s} median {results[key]['median_step_seconds']:7.2f} s/step   "
              f"peak RSS {results[key]['peak_rss_mb']:6.0f} MB (main process)")  # fmt: skip
    results["settings"] = {k: str(v) for k, v in vars(args).items()} | {"torch": torch.__version__}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print(f"Results: {args.output}")


if __name__ == "__main__":
    main()
