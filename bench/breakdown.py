"""Where one of our benchmark steps goes: seconds per phase, how much of it is matmuls, at what rate.

    python bench/breakdown.py          # about a minute; writes bench/results/<date>-breakdown-<machine>.json

Trains our GRPOTrainer on `make bench`'s workload (`bench/worker.py`, at the precision the trainer's
precision='auto' takes on this machine) for `--steps` steps and profiles the last one with
torch.profiler. Phases: generation (`generate_completions`), the log-prob passes run without a
gradient (the reference model's, and the old policy's when num_iterations > 1), the policy's
forward with a gradient, backward, and the rest of the step (rewards, advantages, loss, optimizer).
For each, the time of its matmul ops (`MATMUL_OPS`, self time) and their rate, from the FLOPs their
recorded shapes imply; and, to read those rates against, this CPU's rate on one large product
(`PEAK_SIZE` cubed). A phase whose matmuls run near that peak can only get faster with fewer FLOPs.
The profiler's own cost per op lengthens the profiled step (generation's thousands of small ops
most), so its phases' non-matmul time reads high; the matmuls' self times are their own.
"""

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker  # noqa: E402  (bench/worker.py and bench/run.py, beside this file)
from results_file import results_path  # noqa: E402
from run import machine_info  # noqa: E402

from grpo_hf.engine.cpu import native_bf16  # noqa: E402

PEAK_SIZE = 2048
PHASES = ("generation", "log-prob passes without grad", "policy forward", "backward")
# Each matmul op's FLOPs from its recorded input shapes.
MATMUL_OPS = {
    "aten::mm": lambda a, b, *_: 2 * math.prod(a) * b[-1],  # (M, K) @ (K, N)
    "aten::addmm": lambda bias, a, b, *_: 2 * math.prod(a) * b[-1],
    "aten::bmm": lambda a, b, *_: 2 * math.prod(a) * b[-1],  # (B, M, K) @ (B, K, N)
    "mkldnn::_linear_pointwise": lambda x, w, *_: 2 * math.prod(x) * w[0],  # (..., K) x (N, K)
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps; the last is profiled.")
    parser.add_argument("--output", default=str(results_path("breakdown")))
    return parser.parse_args(argv)


def peak_gflops(dtype: torch.dtype) -> float:
    """GFLOP/s of one (PEAK_SIZE,)^3 product in `dtype` on this CPU, the best of 3."""
    a, b = torch.randn(PEAK_SIZE, PEAK_SIZE, dtype=dtype), torch.randn(PEAK_SIZE, PEAK_SIZE, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * PEAK_SIZE**3 / best / 1e9


def label_phases(trainer) -> None:
    """Wrap the trainer's phases in `record_function` scopes named as in `PHASES`."""
    generate, logps, backward = (
        trainer.generate_completions,
        trainer.completion_logps,
        trainer.accelerator.backward,
    )

    def generate_completions(*args, **kwargs):
        with record_function("generation"):
            return generate(*args, **kwargs)

    def completion_logps(*args, **kwargs):
        name = "policy forward" if torch.is_grad_enabled() else "log-prob passes without grad"
        with record_function(name):
            return logps(*args, **kwargs)

    def accelerator_backward(*args, **kwargs):
        with record_function("backward"):
            return backward(*args, **kwargs)

    trainer.generate_completions, trainer.completion_logps = generate_completions, completion_logps
    trainer.accelerator.backward = accelerator_backward


def phase_of(event) -> str:
    """The `PHASES` scope an event ran in, or 'rest'."""
    while event is not None:
        if event.name in PHASES:
            return event.name
        event = event.cpu_parent
    return "rest"


def breakdown(prof, step_seconds: float) -> dict[str, dict[str, float]]:
    """Per phase: seconds, matmul seconds and matmul GFLOP/s; 'rest' is the step minus the phases."""
    phases = {name: {"seconds": 0.0, "matmul_seconds": 0.0, "gflop": 0.0} for name in (*PHASES, "rest")}
    for event in prof.events():
        if event.name in PHASES:  # a phase's own scope; phases do not nest
            phases[event.name]["seconds"] += event.cpu_time_total / 1e6
        elif event.name in MATMUL_OPS:
            phase = phases[phase_of(event)]
            phase["matmul_seconds"] += event.self_cpu_time_total / 1e6
            phase["gflop"] += MATMUL_OPS[event.name](*event.input_shapes) / 1e9
    phases["rest"]["seconds"] = step_seconds - sum(phases[name]["seconds"] for name in PHASES)
    for phase in phases.values():
        phase["matmul_gflops"] = phase["gflop"] / phase["matmul_seconds"] if phase["matmul_seconds"] else 0.0
    return phases


def main() -> None:
    args = parse_args()
    precision = "bf16" if native_bf16() else "fp32"
    worker_args = worker.parse_args(
        ["--side", "ours", "--precision", precision, "--steps", str(args.steps), "--output", args.output]
    )
    with tempfile.TemporaryDirectory(prefix="bench-breakdown-") as output_dir:
        trainer, _ = worker.build_trainer(worker_args, output_dir)
        label_phases(trainer)
        timer = worker.StepTimer()
        trainer.add_callback(timer)
        profiled = ProfileLastStep(args.steps)
        trainer.add_callback(profiled)
        trainer.train()
    phases = breakdown(profiled.prof, timer.seconds[-1])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    report = {
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "precision": precision,
        "step_seconds": timer.seconds,
        "profiled_step_seconds": timer.seconds[-1],
        "profiled_step_mean_completion_length": worker.per_step_logs(trainer.state.log_history)[-1][
            "completions/mean_length"
        ],
        "peak_matmul_gflops": peak_gflops(dtype),
        "phases": phases,
    }
    machine = report["machine"]
    print(f"{machine['cpu_model']} ({machine['cpu_capability']}), {report['threads']} threads, {precision}")
    print(
        f"profiled step: {timer.seconds[-1]:.2f} s, completions of {report['profiled_step_mean_completion_length']:.1f}"
        f" tokens on average (all steps: {', '.join(f'{s:.2f}' for s in timer.seconds)} s; the profiler"
        " lengthens its step, most in generation's many small ops)"
    )
    print(f"{'phase':<30} {'s':>6} {'matmul s':>9} {'matmul GFLOP/s':>15}")
    for name, phase in phases.items():
        print(
            f"{name:<30} {phase['seconds']:>6.2f} {phase['matmul_seconds']:>9.2f} "
            f"{phase['matmul_gflops']:>15.1f}"
        )
    print(f"this CPU's {precision} matmul peak ({PEAK_SIZE}^3): {report['peak_matmul_gflops']:.1f} GFLOP/s")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))


class ProfileLastStep(TrainerCallback):
    """torch.profiler around the last optimizer step (with shapes, for the FLOPs)."""

    def __init__(self, steps: int):
        self.steps, self.prof, self._context = steps, None, contextlib.ExitStack()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.steps - 1:
            self.prof = self._context.enter_context(
                profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            )

    def on_step_end(self, args, state, control, **kwargs):
        self._context.close()


if __name__ == "__main__":
    main()
