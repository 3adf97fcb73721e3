"""What the importance weights do to the gradient under top_p, with the trainer's log-probs
renormalised over the support the sampler kept (renormalize_truncated_sampling, TRL 1.17's
behaviour) and over the whole vocabulary (grpo-hf before).

    python bench/truncated_sampling.py [--steps 3] [--top-p 0.9] [--output bench/results/truncated_sampling.json]

A tiny random Llama (the tests' `tiny_llama`: nearly flat distributions over 259 tokens, so top_p
keeps about that share of every token's mass) trains `--steps` steps of 2 prompts x 4 completions
of up to 16 tokens with our decoder, sampling from the float32 policy itself: on the truncated
support pi_old / pi_sampler is 1 up to rounding, so a weight below 1 is the kept mass and nothing
else. Each importance-sampling mode (token_truncate, and sequence_mask, vLLM's default in TRL and
here, both at clip_max 3) runs with renormalize_truncated_sampling on and off; every run logs, per
step, the mean weight over the loss tokens (`sampling/importance_sampling_ratio/mean`) and the
gradient norm before clipping (`grad_norm`). Every run has the same seed, so the first step's
completions, advantages and old log-probs are the same in all of them: its gradient norms compare
directly, one run against another. Later steps follow each run's own updates.
"""

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import tiny_llama, tiny_tokenizer  # noqa: E402
from trainer_helpers import chat_dataset, length_reward  # noqa: E402
from transformers import PrinterCallback  # noqa: E402

from grpo_hf import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_hf.algorithm.sampler_correction import SamplerCorrection  # noqa: E402

MODES = ("token_truncate", "sequence_mask")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--output", default=None, help="Also write the report here as JSON.")
    return parser.parse_args(argv)


def run(mode: str, renormalize: bool, args: argparse.Namespace, folder: str) -> list[dict[str, float]]:
    """Each step's mean importance weight and gradient norm, for one mode, renormalised or not."""
    config = GRPOConfig(
        output_dir=folder, report_to=[], use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
        save_strategy="no", logging_steps=1, max_steps=args.steps, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=16, learning_rate=1e-2, top_p=args.top_p,
        sampler_is_cap=3.0, renormalize_truncated_sampling=renormalize,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=config,
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.remove_callback(PrinterCallback)  # the table below says it all
    # Our decoder takes sampler_is_cap (token_truncate); the sequence modes are vLLM's settings, set
    # here on the loss as `vllm_importance_sampling_mode` would set them.
    correction = SamplerCorrection(mode, None, 3.0)
    trainer.loss_settings = dataclasses.replace(trainer.loss_settings, sampler_correction=correction)
    trainer.train()
    return [
        {"is_weight_mean": log["sampling/importance_sampling_ratio/mean"], "grad_norm": log["grad_norm"]}
        for log in trainer.state.log_history
        if "grad_norm" in log
    ]


def main() -> None:
    args = parse_args()
    report = {"top_p": args.top_p, "steps": args.steps, "runs": {}}
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            for renormalize in (True, False):
                name = f"{mode}, {'renormalised' if renormalize else 'whole vocabulary'}"
                report["runs"][name] = run(mode, renormalize, args, folder)
    print(f"top_p={args.top_p}: mean importance weight / gradient norm per step")
    for name, steps in report["runs"].items():
        cells = "  ".join(f"{s['is_weight_mean']:.3f} / {s['grad_norm']:.4f}" for s in steps)
        print(f"{name:<38} {cells}")
    for mode in MODES:
        kept = report["runs"][f"{mode}, whole vocabulary"][0]["grad_norm"]
        full = report["runs"][f"{mode}, renormalised"][0]["grad_norm"]
        print(
            f"{mode}: first step's gradient norm over the whole vocabulary / renormalised = {kept / full:.3f}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
