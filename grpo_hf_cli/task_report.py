"""A built-in task's held-out greedy accuracy before and after training, its plot and results.json.

`evaluate` decodes with the trainer's policy, on every process (a sharded model is gathered whole
for it, `unsharded_for_generation`) and scores on the main process only. Before training the
policy is the base model (a fresh LoRA adapter adds exactly zero), after it the trained one.
"""

import json
import os

import torch
from accelerate import PartialState
from datasets import Dataset
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.evaluation import greedy_accuracy
from grpo_hf.models.sharding import unsharded_for_generation
from grpo_hf.plotting import plot_training
from grpo_hf.tasks import Task


def evaluate(trainer: GRPOTrainer, test: Dataset, task: Task, max_new_tokens: int) -> dict | None:
    """`evaluate_model` of the trainer's policy on the main process; None on the others. Every
    process must call it."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.eval()
    with unsharded_for_generation(policy, trainer.accelerator):
        if not PartialState().is_main_process:
            return None
        return evaluate_model(policy, trainer.processing_class, test, task, max_new_tokens, trainer.args)


def evaluate_model(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    test: Dataset,
    task: Task,
    max_new_tokens: int,
    args: GRPOConfig,
) -> dict:
    """Greedy held-out accuracy, a few samples, and tool calls per episode for a task with tools."""
    result = greedy_accuracy(
        model,
        tokenizer,
        test,
        task.accuracy,
        max_new_tokens=max_new_tokens,
        tools=task.tools,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        tool_timeout=args.tool_timeout,
    )
    return {
        "accuracy": result.accuracy,
        "samples": result.samples,
        "tool_calls": result.tool_calls_per_episode,
    }


def report(
    task_name: str, num_test: int, trainer: GRPOTrainer, before: dict, after: dict, train_seconds: float
) -> None:
    """Print before / after accuracy and samples; write them to results.json, the plot to training.png."""
    output_dir, steps = trainer.args.output_dir, trainer.state.global_step
    plot_path = plot_training(trainer.state.log_history, os.path.join(output_dir, "training.png"))
    results = {
        "task": task_name,
        "steps": steps,
        "train_seconds": round(train_seconds, 1),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "tool_calls_before": before["tool_calls"],
        "tool_calls_after": after["tool_calls"],
        "torch_threads": torch.get_num_threads(),
    }
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(
            {**results, "samples_before": before["samples"], "samples_after": after["samples"]}, f, indent=1
        )
    print(f"\nHeld-out greedy accuracy ({num_test} {task_name} problems):")
    print(
        f"  before: {before['accuracy']:.1%}   after: {after['accuracy']:.1%}   ({steps} steps, {train_seconds:.0f} s)"
    )
    if before["tool_calls"] is not None:
        print(
            f"  tool calls per episode: before {before['tool_calls']:.2f}   after {after['tool_calls']:.2f}"
        )
    for title, samples in (("before", before["samples"]), ("after", after["samples"])):
        print(f"Sample completions {title} training:")
        for question, completion, reward in samples:
            print(f"  [{reward:.0f}] {question[-50:]!r} -> {completion.strip()[:60]!r}")
    print(f"Plot: {plot_path}   adapter/model: {output_dir}   results: {output_dir}/results.json")
