"""Our GRPO step against TRL's on the same machine and workload: per-step time, peak RSS, tokens/s.

    python bench/run.py                                   # ours vs TRL, each at the precisions this CPU runs natively
    python bench/run.py --sides ours --steps 2 --max-completion-length 8    # a quick check, no TRL
    python bench/run.py --sides ours,ours-int8,trl        # our side also with int8 rollouts

Each side and precision trains in its own subprocess (`bench/worker.py`), one after the other, so
timings do not overlap and every peak RSS belongs to one side. The workload is described in the
worker's docstring. The whole sequence runs `--rounds` times, every other round in reverse order
(ours, TRL, TRL, ours), so that a machine whose speed drifts during the benchmark favours neither
side. The step time of a side is the median over its steps after the first of each run; each side
is scored at its fastest precision, and the ratio is TRL's median over ours (the goal, issue 46's:
>= 5 on a CPU that multiplies bf16 natively, >= 3 on one that does not).
`auto` precisions (the default) run bf16 only on a CPU that multiplies it natively (AVX-512-BF16 or
AMX): elsewhere bf16 matmuls are emulated and a bf16 side would take an hour to say it is slower
than its own float32, so it is skipped, and the output says so; name it explicitly to run it anyway.
Everything, with machine information and the commands to rerun, goes to
bench/results/<date>-bench-<machine>.json (`bench/results_file.py`). The side `ours-int8` is ours
with `rollout_quantization='int8'` (the sampler's matmuls on int8 weights), at our precisions,
scored against TRL on its own line.

TRL is needed only for `--sides trl`: `pip install -e ".[bench]"` (or `make bench`).
"""

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from grpo_hf.engine.cpu import native_bf16

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from results_file import results_path  # noqa: E402
from worker import SIDES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "worker.py"
GOAL_RATIOS = {True: 5.0, False: 3.0}  # by native_bf16(): an AVX-512-BF16 / AMX CPU, an AVX2-only one
BUSY_SHARE = 0.1  # CPU share of other processes during a run above which its timings are suspect
PRECISIONS = ("fp32", "bf16")
# Environment variables that change which kernels run: a run under them is not the CPU's own run (an
# AVX-512 CPU held to AVX2 kernels, say), so the report records them and its rerun commands set them.
KERNEL_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "GRPO_HF_CPU_BF16",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line settings; the workload defaults are the issue's (G=8, 2 prompts, 48 tokens)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="ours,trl", help="Comma-separated: ours, ours-int8, trl.")
    parser.add_argument(
        "--ours-precisions",
        default="auto",
        help="Comma-separated: fp32, bf16; auto: bf16 if native, else fp32.",
    )
    parser.add_argument(
        "--trl-precisions",
        default="auto",
        help="Comma-separated: fp32, bf16; auto: fp32, and bf16 if native.",
    )
    parser.add_argument(
        "--steps", type=int, default=6, help="Optimizer steps per side; the first is not timed."
    )
    parser.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (G).")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="Prompts per optimizer step.")
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker; default torch's."
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="Runs per side and precision, alternating the order."
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="Both sides generate with vLLM colocate (use_vllm=True; a GPU run).",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds before a worker is stopped.")
    parser.add_argument("--output", default=str(results_path("bench")))
    args = parser.parse_args(argv)
    args.sides = _choices(parser, "--sides", args.sides, SIDES)
    auto = {side: getattr(args, f"{side}_precisions") == "auto" for side in ("ours", "trl")}
    args.ours_precisions = _precisions(parser, "ours", args.ours_precisions)
    args.trl_precisions = _precisions(parser, "trl", args.trl_precisions)
    # The bf16 runs 'auto' leaves out, of the sides that run: named in the report.
    args.skipped = [f"{side}_bf16" for side in args.sides if auto[precision_side(side)] and not native_bf16()]
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is a warm-up and is not timed.")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1.")
    return args


def _choices(parser: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items or any(item not in allowed for item in items):
        parser.error(f"{flag}={value!r}: give a comma-separated list from {', '.join(allowed)}.")
    return list(dict.fromkeys(items))


def _precisions(parser: argparse.ArgumentParser, side: str, value: str) -> list[str]:
    """A side's precisions; 'auto' drops bf16 where this CPU has no native bf16."""
    if value != "auto":
        return _choices(parser, f"--{side}-precisions", value, PRECISIONS)
    if native_bf16():
        return ["bf16"] if side == "ours" else ["fp32", "bf16"]
    return ["fp32"]


def precision_side(side: str) -> str:
    """Whose precisions a side runs at: ours-int8 at ours'."""
    return "trl" if side == "trl" else "ours"


def runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(side, precision) pairs in the order they run: every other round reversed."""
    precisions = {"ours": args.ours_precisions, "trl": args.trl_precisions}
    one_round = [(side, precision) for side in args.sides for precision in precisions[precision_side(side)]]
    return [pair for r in range(args.rounds) for pair in (one_round if r % 2 == 0 else one_round[::-1])]


def merge_rounds(reports: list[dict]) -> dict:
    """One entry per side and precision from its runs: medians over every timed step of every run."""
    failed = [r for r in reports if "error" in r]
    if failed:
        return failed[0]
    timed_steps = [s for r in reports for s in r["step_seconds"][1:]]
    timed_tps = [t for r in reports for t in r["tokens_per_second"][1:]]
    return {
        "side": reports[0]["side"],
        "precision": reports[0]["precision"],
        "runs": len(reports),
        "median_step_seconds": statistics.median(timed_steps),
        "timed_step_seconds": timed_steps,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reports),
        "median_tokens_per_second": statistics.median(timed_tps),
        "tokens_per_second_method": reports[0]["tokens_per_second_method"],
        "mean_completion_length": statistics.mean(r["mean_completion_length"] for r in reports),
        "seconds_per_1k_completion_tokens": statistics.mean(
            r["seconds_per_1k_completion_tokens"] for r in reports
        ),
        "torch_threads": reports[0]["torch_threads"],
        "other_processes_cpu_share": max(r["other_processes_cpu_share"] or 0.0 for r in reports),
        "per_run": reports,
    }


def worker_command(args: argparse.Namespace, side: str, precision: str, output: Path) -> list[str]:
    """The command line of one side's worker."""
    command = [
        sys.executable, str(WORKER), "--side", side, "--precision", precision,
        "--steps", str(args.steps), "--num-generations", str(args.num_generations),
        "--prompts-per-step", str(args.prompts_per_step),
        "--max-completion-length", str(args.max_completion_length),
        "--learning-rate", str(args.learning_rate), "--beta", str(args.beta), "--seed", str(args.seed),
        "--output", str(output),
    ]  # fmt: skip
    command += ["--vllm"] if args.vllm else []
    return command + (["--threads", str(args.threads)] if args.threads is not None else [])


def run_worker(command: list[str], log_path: Path, result_path: Path, timeout: float) -> dict:
    """Run one worker, its output going to `log_path`; its report, or an error entry."""
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    machine_before, own_before = machine_busy_seconds(), children_cpu_seconds()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            process = subprocess.run(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
            failure = f"exit code {process.returncode}" if process.returncode else None
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    other = None
    if machine_before is not None:
        foreign = machine_busy_seconds() - machine_before - (children_cpu_seconds() - own_before)
        other = max(foreign, 0.0) / (wall * (os.cpu_count() or 1))
    context = {"wall_seconds": wall, "other_processes_cpu_share": other, "log": str(log_path)}
    if failure is None and result_path.is_file():
        return {**json.loads(result_path.read_text()), **context}
    tail = log_path.read_text().strip().splitlines()[-15:]
    return {"error": failure or "no report written", "log": str(log_path), "log_tail": tail}


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes have used since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is inside user


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (the workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def kernel_settings() -> dict[str, str]:
    """The `KERNEL_VARIABLES` this run has set."""
    return {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ}


def with_kernel_settings(words: list[str]) -> str:
    """A command line that runs `words` under this run's `kernel_settings`."""
    settings = [f"{name}={value}" for name, value in kernel_settings().items()]
    return shlex.join(["env", *settings, *words] if settings else words)


def rerun_command() -> str:
    """This run's command line, from the repository root."""
    script = os.path.relpath(Path(sys.argv[0]).resolve(), ROOT)
    return f"cd {shlex.quote(str(ROOT))} && " + with_kernel_settings([sys.executable, script, *sys.argv[1:]])


def machine_info() -> dict:
    """CPU, cores, load and library versions (TRL's from its metadata: this process never imports it)."""
    cpu_model = "unknown"
    if os.path.isfile("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("torch", "transformers", "trl", "peft", "accelerate"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu_model": cpu_model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(),
        "kernel_settings": kernel_settings(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def best(results: dict[str, dict], side: str) -> str | None:
    """The key of a side's fastest successful run."""
    keys = [key for key, r in results.items() if r.get("side") == side and "error" not in r]
    return min(keys, key=lambda key: results[key]["median_step_seconds"], default=None)


def summarize(results: dict[str, dict]) -> dict:
    """Each side at its fastest precision, and TRL's median step time over ours (and over ours-int8's,
    when it ran, under keys ending in _int8)."""
    goal = GOAL_RATIOS[native_bf16()]
    summary = {"trl": best(results, "trl"), "goal_ratio": goal}
    for side, suffix in (("ours", ""), ("ours-int8", "_int8")):
        ours, trl = best(results, side), summary["trl"]
        ratio = per_token_ratio = None
        if ours and trl:
            ratio = results[trl]["median_step_seconds"] / results[ours]["median_step_seconds"]
            per_token_ratio = (
                results[trl]["seconds_per_1k_completion_tokens"]
                / results[ours]["seconds_per_1k_completion_tokens"]
            )
        if side == "ours" or ours:
            summary |= {
                f"ours{suffix}": ours,
                f"ratio_trl_over_ours{suffix}": ratio,
                f"ratio_per_completion_token{suffix}": per_token_ratio,
                f"meets_goal{suffix}": None if ratio is None else ratio >= goal,
            }
    return summary


def print_report(report: dict) -> None:
    """A table of every run, the ratio, and the commands to rerun."""
    machine = report["machine"]
    print(
        f"\nMachine: {machine['cpu_model']} ({machine['cpu_capability']}, native bf16: "
        f"{'yes' if machine['native_bf16'] else 'no'}), {machine['usable_cores']} cores, "
        f"load {machine['load_average_at_start']}"
    )
    for key in report["skipped"]:
        print(
            f"{key:<10} skipped: this CPU has no native bf16 (emulated bf16 matmuls); name it to run it anyway"
        )
    print(f"Versions: {machine['versions']}")
    header = f"{'run':<10} {'median s/step':>13} {'peak RSS MB':>11} {'gen tok/s':>9} {'mean len':>8} threads {'other CPU':>9}"
    print(header)
    for key, r in report["runs"].items():
        if "error" in r:
            print(f"{key:<10} FAILED ({r['error']}); log: {r['log']}")
            continue
        print(
            f"{key:<10} {r['median_step_seconds']:>13.2f} {r['peak_rss_mb']:>11.0f} "
            f"{r['median_tokens_per_second']:>9.1f} {r['mean_completion_length']:>8.1f} {r['torch_threads']:>7} "
            f"{_percent(r['other_processes_cpu_share']):>9}"
        )
    for key, r in report["runs"].items():
        if "error" not in r:
            print(f"  {key} tokens/s: {r['tokens_per_second_method']}")
    busy = [
        key for key, r in report["runs"].items() if (r.get("other_processes_cpu_share") or 0) > BUSY_SHARE
    ]
    if busy:
        shares = ", ".join(f"{key} {report['runs'][key]['other_processes_cpu_share']:.0%}" for key in busy)
        print(
            f"  WARNING: other processes used this share of the CPU during a run: {shares}. They slow that "
            "side down, so the timings are not comparable; rerun on an idle machine."
        )
    summary = report["summary"]
    for suffix in ("", "_int8"):
        if summary.get(f"ratio_trl_over_ours{suffix}") is not None:
            print(
                f"Ratio (TRL {summary['trl']} median / ours {summary[f'ours{suffix}']} median): "
                f"{summary[f'ratio_trl_over_ours{suffix}']:.2f}x (goal >= {summary['goal_ratio']:.0f}x: "
                f"{'met' if summary[f'meets_goal{suffix}'] else 'not met'}); per completion token (the sides "
                f"sample different lengths): {summary[f'ratio_per_completion_token{suffix}']:.2f}x"
            )
    print("Rerun everything:  " + report["commands"]["run"])
    for key, command in report["commands"]["workers"].items():
        print(f"Rerun {key}:  {command}")


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def main() -> None:
    args = parse_args()
    output = Path(args.output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    if "trl" in args.sides and machine["versions"]["trl"] is None:
        sys.exit('TRL is not installed: pip install -e ".[bench]" (or `make bench`), or pass --sides ours.')
    reports: dict[str, list[dict]] = {}
    commands = {}
    for number, (side, precision) in enumerate(runs(args)):
        key = f"{side}_{precision}"
        result_path = output.parent / f"{output.stem}.{key}.json"
        command = worker_command(args, side, precision, result_path)
        commands[key] = with_kernel_settings(command)
        print(f"[bench] {key} (run {number + 1} of {len(runs(args))}): {args.steps} steps ...", flush=True)
        log_path = output.parent / f"{output.stem}.{key}.{len(reports.get(key, []))}.log"
        report = run_worker(command, log_path, result_path, args.timeout)
        reports.setdefault(key, []).append(report)
        if "error" in report:
            print(f"[bench] {key} failed: {report['error']}\n  " + "\n  ".join(report["log_tail"]))
    results = {key: merge_rounds(runs_of_key) for key, runs_of_key in reports.items()}
    report = {
        "machine": machine,
        "load_average_at_end": os.getloadavg(),
        "workload": {
            "model": "smollm2-135m-instruct (grpo_hf embedded default), LoRA r=16 alpha=32 on q/k/v/o",
            "task": "arithmetic a + b, a and b in 0..50; reward accuracy_reward",
            "num_generations": args.num_generations,
            "prompts_per_step": args.prompts_per_step,
            "completions_per_step": args.num_generations * args.prompts_per_step,
            "max_completion_length": args.max_completion_length,
            "temperature": 1.0,
            "beta": args.beta,
            "num_iterations": 1,
            "learning_rate": args.learning_rate,
            "seed": args.seed,
            "steps": args.steps,
            "timed_steps": args.steps - 1,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "runs": results,
        "skipped": args.skipped,
        "summary": summarize(results),
        "commands": {"run": rerun_command(), "make": "make bench", "workers": commands},
    }
    output.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"Results: {output}")
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
