"""Held-out accuracy against training steps for `make train`'s recipe: still rising, or stopped?

    python bench/learning_curve.py --steps 100 --every 20 [--name NAME] [--core N] [--trainer trl] [-- recipe flags]
    python bench/learning_curve.py --steps 60 --every 60 --seeds 1 2 3 --name int8 -- --rollout_quantization int8

Runs `recipes/grpo.py` with its config (`make train`'s unless `--config`), a checkpoint every
`--every` steps, the flags after `--` on top (any `GRPOConfig` or script setting, as on the
recipe's command line); then scores every checkpoint on the task's held-out split with the recipe's
own evaluation (`grpo_hf_cli`: the script recipes/grpo.py runs, its settings parsed by its parser).
Prints step and accuracy and writes `bench/results/<date>-learning_curve-<name>-<machine>.json`,
with what the run logged of the sampler against the policy (the mean of `sampler/kl`, the least
`sampler/ratio_min`) and its median `step_time`, from the last checkpoint's `trainer_state.json`.
`--seeds S1 S2 ...` runs once per seed (`--seed S` after the other flags), each as `<name>-seed<S>`
with its own results file, then writes `<date>-learning_curve-<name>-<machine>.json` with each
seed's last accuracy and their mean: a comparison of two settings (say int8 rollouts or not) is two
such commands with the same seeds. `--core N` pins the run to CPU core N with one thread,
so that two runs share a 2-core machine without their threads fighting: for accuracy, not timing
(one thread changes the sums' order, so such a run samples other completions than `make train`).
`--score-only` scores an earlier run's checkpoints again (same `--name`, flags and `--output-root`).
`--trainer trl` trains with TRL's GRPOTrainer instead (`bench/trl_recipe.py`: the same settings,
model, data and rewards; one process), scored the same way: is a plateau the model's or ours?
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from peft import PeftModel

from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer
from grpo_hf.models.policy import model_init_kwargs, tokenizer_init_kwargs
from grpo_hf.tasks import TASKS
from grpo_hf_cli import grpo as script
from grpo_hf_cli.task_report import evaluate_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from results_file import results_path  # noqa: E402
from run import machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "grpo.py"
TRL_RECIPE = Path(__file__).resolve().parent / "trl_recipe.py"
CONFIG = ROOT / "recipes" / "configs" / "smollm2_lora_arithmetic.yaml"
SECONDS_FILE = "learning_curve_seconds.txt"  # in the run's folder: its training's wall-clock seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="max_steps of the run")
    parser.add_argument(
        "--every", type=int, default=20, help="a checkpoint (and an evaluation) every N steps"
    )
    parser.add_argument("--config", type=Path, default=CONFIG, help="the recipe's YAML config")
    parser.add_argument("--name", default="default", help="names the output folder and the results file")
    parser.add_argument("--core", type=int, default=None, help="pin to this core, one thread")
    parser.add_argument(
        "--trainer", choices=("ours", "trl"), default="ours", help="whose GRPOTrainer trains (trl: needs TRL)"
    )
    parser.add_argument("--output-root", type=Path, default=ROOT / "outputs" / "learning_curve")
    parser.add_argument(
        "--score-only",
        action="store_true",
        help="score the checkpoints of an earlier run of this name, no training",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="one run per seed (--seed S for the recipe)"
    )
    parser.add_argument("recipe_flags", nargs="*", help="after --: flags for recipes/grpo.py")
    args = parser.parse_args(argv)
    if args.steps < 1 or not 1 <= args.every <= args.steps:
        parser.error(f"--steps {args.steps} and --every {args.every}: need 1 <= every <= steps.")
    return args


def recipe_args(args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The recipe's command line: the config, a checkpoint every `args.every` steps, the user's flags last."""
    return ["--config", str(args.config), "--output_dir", str(output_dir), "--max_steps", str(args.steps),
            "--save_steps", str(args.every), "--save_strategy", "steps",
            "--save_total_limit", str(args.steps // args.every + 1), "--report_to", "none",
            *args.recipe_flags]  # fmt: skip


def train(args: argparse.Namespace, output_dir: Path) -> float:
    """The recipe, launched as `make train` launches it (or TRL's side); returns its wall-clock seconds."""
    if args.trainer == "trl":
        command = [sys.executable, str(TRL_RECIPE), *recipe_args(args, output_dir)]
    else:
        device = "gpu" if torch.cuda.is_available() else "cpu"  # the Makefile's ACCELERATE_CONFIG choice
        launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                    str(ROOT / "recipes" / "accelerate" / f"{device}.yaml")]  # fmt: skip
        command = [*launcher, str(RECIPE), *recipe_args(args, output_dir)]
    env = dict(os.environ, WANDB_MODE="disabled")
    if args.core is not None:
        command = ["taskset", "-c", str(args.core), *command]
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def recipe_seconds(args: argparse.Namespace, output_dir: Path) -> float | None:
    """Train (unless --score-only) and return the recipe's wall-clock seconds, kept in the run's
    folder (`SECONDS_FILE`) so that a --score-only run reports the training it scores (None where
    that training wrote none)."""
    saved = output_dir / SECONDS_FILE
    if args.score_only:
        return float(saved.read_text()) if saved.exists() else None
    seconds = round(train(args, output_dir), 1)
    saved.write_text(f"{seconds}\n")
    return seconds


def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = [(int(p.name.split("-")[1]), p) for p in output_dir.glob("checkpoint-*") if p.name[11:].isdigit()]
    return sorted(found)


def checkpoint_model(model_name: str, config, path: Path):
    """A LoRA checkpoint's adapter on its base model, or a full fine-tuning checkpoint's weights."""
    if (path / "adapter_config.json").exists():
        base = load_model(model_name, **model_init_kwargs(config))
        return PeftModel.from_pretrained(base, path).eval()
    return load_model(str(path), **model_init_kwargs(config)).eval()


def evaluate(settings: tuple, output_dir: Path) -> list[dict]:
    """Each checkpoint scored by the recipe's own evaluation, as it scores the final model."""
    run, config, model_args, mixture = settings
    task, data = TASKS[run.task], script.load_data(run, config, mixture)
    model_name = model_args.model_name_or_path or DEFAULT_MODEL
    tokenizer = load_tokenizer(model_name, **tokenizer_init_kwargs(config))
    curve = []
    for step, path in checkpoints(output_dir):
        model = checkpoint_model(model_name, config, path)
        accuracy = evaluate_model(model, tokenizer, data["test"], task, run.eval_max_new_tokens, config)[
            "accuracy"
        ]
        curve.append({"step": step, "accuracy": accuracy})
        print(f"step {step:4d}: held-out greedy accuracy {accuracy:.1%}", flush=True)
    return curve


def logged(output_dir: Path) -> dict:
    """What the run logged that a comparison of samplers wants, from its last checkpoint's log
    history: the mean of `sampler/kl`, the least `sampler/ratio_min`, the median `step_time`
    (each None where the run logged none)."""
    found = checkpoints(output_dir)
    history = json.loads((found[-1][1] / "trainer_state.json").read_text())["log_history"] if found else []

    def values(key):
        return [entry[key] for entry in history if key in entry]

    kl, ratio_min, step_time = values("sampler/kl"), values("sampler/ratio_min"), values("step_time")
    return {"sampler_kl_mean": statistics.mean(kl) if kl else None,
            "sampler_ratio_min": min(ratio_min) if ratio_min else None,
            "step_time_median": statistics.median(step_time) if step_time else None}  # fmt: skip


def seed_runs(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The runs `--seeds` asks for: each named `<name>-seed<S>`, `--seed S` after the user's flags
    (the last flag wins); without `--seeds`, the run as given."""
    if args.seeds is None:
        return [args]
    return [
        argparse.Namespace(
            **{
                **vars(args),
                "name": f"{args.name}-seed{seed}",
                "recipe_flags": [*args.recipe_flags, "--seed", str(seed)],
            }
        )  # fmt: skip
        for seed in args.seeds
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    reports = [run(one) for one in seed_runs(args)]
    if args.seeds is None:
        return
    last = {seed: report["curve"][-1]["accuracy"] if report["curve"] else None
            for seed, report in zip(args.seeds, reports, strict=True)}  # fmt: skip
    scored = [accuracy for accuracy in last.values() if accuracy is not None]
    summary = {"name": args.name, "flags": args.recipe_flags, "steps": args.steps, "last_accuracy": last,
               "mean_last_accuracy": sum(scored) / len(scored) if scored else None,
               "sampler_kl_mean": {seed: report["logged"]["sampler_kl_mean"]
                                   for seed, report in zip(args.seeds, reports, strict=True)},
               "runs": [results_path(f"learning_curve-{report['name']}").name for report in reports]}  # fmt: skip
    results_path(f"learning_curve-{args.name}").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


def run(args: argparse.Namespace) -> dict:
    """One run: train (unless --score-only), score its checkpoints, write and return its report."""
    output_dir = args.output_root / args.name
    settings = script.parse(recipe_args(args, output_dir))  # before training: a bad flag fails at once
    seconds = recipe_seconds(args, output_dir)
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
        torch.set_num_threads(1)
    curve = evaluate(settings, output_dir)
    results = output_dir / "results.json"  # the recipe's; TRL's side evaluates nothing before training
    before = json.loads(results.read_text())["accuracy_before"] if results.exists() else None
    report = {"name": args.name, "trainer": args.trainer, "config": str(args.config.relative_to(ROOT)),
              "flags": args.recipe_flags, "steps": args.steps, "core": args.core, "recipe_seconds": seconds,
              "accuracy_before": before, "logged": logged(output_dir), "curve": curve,
              "machine": machine_info()}  # fmt: skip
    output = results_path(f"learning_curve-{args.name}")
    output.parent.mkdir(exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "curve"}))
    return report


if __name__ == "__main__":
    main()
