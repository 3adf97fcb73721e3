"""GRPO on a built-in verifiable task, end to end: evaluate, train, evaluate, plot, save.

    accelerate launch --config_file recipes/accelerate/cpu.yaml recipes/grpo.py \\
        --config recipes/configs/smollm2_lora_arithmetic.yaml [--any_setting value ...]

Settings come from three dataclasses (ScriptArguments, ModelArguments, GRPOConfig), parsed by
`TrlParser` as TRL's scripts are: the YAML file gives defaults, command-line flags override it.
"""

import json
import os
import time
from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from datasets import DatasetDict
from peft import LoraConfig

from grpo_hf import GRPOConfig, GRPOTrainer, TrlParser
from grpo_hf.evaluation import greedy_accuracy
from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer
from grpo_hf.models.policy import model_init_kwargs, tokenizer_init_kwargs
from grpo_hf.models.sharding import unsharded_for_generation
from grpo_hf.plotting import plot_training
from grpo_hf.tasks import TASKS, Task


@dataclass
class ScriptArguments:
    task: str = field(default="arithmetic", metadata={"help": f"Built-in task: one of {sorted(TASKS)}."})
    num_train: int = field(default=2000, metadata={"help": "Training problems to generate."})
    num_test: int = field(default=200, metadata={"help": "Held-out problems for greedy accuracy."})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Greedy evaluation completion length."})
    merge_adapter: bool = field(
        default=False, metadata={"help": "Also save the LoRA merged into the weights."}
    )


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=DEFAULT_MODEL, metadata={"help": "Hub id, local folder, .gguf file, or the embedded default."}
    )
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "Module names to adapt (GPT-2: c_attn)."},
    )


def evaluate(model, tokenizer, dataset, task, script: ScriptArguments, args: GRPOConfig) -> dict:
    """Greedy held-out accuracy; for a task with tools, greedy episodes (tool calls per episode too)."""
    result = greedy_accuracy(
        model,
        tokenizer,
        dataset,
        task.accuracy,
        max_new_tokens=script.eval_max_new_tokens,
        tools=task.tools,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        tool_timeout=args.tool_timeout,
    )
    return {
        "accuracy": result.accuracy,
        "samples": result.samples,
        "tool_calls": result.tool_calls_per_episode,
    }


def task_data(script: ScriptArguments, args: GRPOConfig) -> tuple[Task, DatasetDict]:
    """The task the settings name, and its train and held-out splits as every run draws them."""
    if script.task not in TASKS:
        raise ValueError(f"task={script.task!r} is not one of {sorted(TASKS)}.")
    task = TASKS[script.task]
    return task, task.build(num_train=script.num_train, num_test=script.num_test, seed=args.seed)


def lora_config(model_args: ModelArguments) -> LoraConfig | None:
    """The LoRA adapter the settings ask for; None for full fine-tuning."""
    if not model_args.use_peft:
        return None
    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        task_type="CAUSAL_LM",
    )


def parse(args: list[str] | None = None) -> tuple[ScriptArguments, ModelArguments, GRPOConfig]:
    """The settings of a run: YAML defaults from --config (and its env: section), overridden by flags
    on the command line (`args`, else sys.argv)."""
    return TrlParser((ScriptArguments, ModelArguments, GRPOConfig)).parse_args_and_config(args)


def main() -> None:
    train_and_report(*parse())
    # Left to interpreter exit, the process group's threads can abort a finished run (SIGABRT).
    PartialState().destroy_process_group()


def train_and_report(script: ScriptArguments, model_args: ModelArguments, args: GRPOConfig) -> None:
    """Evaluate, train, save; then, on the main process, evaluate again, plot and report."""
    task, data = task_data(script, args)
    state = PartialState()
    if script.merge_adapter and state.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ValueError(
            "merge_adapter needs the whole model in one process; under FSDP or DeepSpeed, train without it and "
            "merge the saved adapter afterwards (PeftModel.from_pretrained(base, output_dir).merge_and_unload())."
        )
    tokenizer = load_tokenizer(model_args.model_name_or_path, **tokenizer_init_kwargs(args))
    model = load_model(
        model_args.model_name_or_path, **model_init_kwargs(args)
    )  # as GRPOTrainer loads by name
    peft_config = lora_config(model_args)
    with unsharded_for_generation(model):  # ZeRO-3 partitions models as they load
        before = (
            evaluate(model, tokenizer, data["test"], task, script, args) if state.is_main_process else None
        )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task.rewards,
        args=args,
        train_dataset=data["train"],
        processing_class=tokenizer,
        peft_config=peft_config,
        tools=task.tools or None,
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - start
    trainer.save_model(args.output_dir)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.eval()
    # Whole weights on every process, so that the main process can decode alone under FSDP / ZeRO-3.
    with unsharded_for_generation(policy, trainer.accelerator):
        after = (
            evaluate(policy, tokenizer, data["test"], task, script, args) if state.is_main_process else None
        )
    if not state.is_main_process:
        return
    if model_args.use_peft and script.merge_adapter:
        merged_dir = os.path.join(args.output_dir, "merged")
        policy.merge_and_unload().save_pretrained(merged_dir)
        tokenizer.save_pretrained(merged_dir)
    plot_path = plot_training(trainer.state.log_history, os.path.join(args.output_dir, "training.png"))
    report(script, args, before, after, train_seconds, trainer.state.global_step, plot_path)


def report(script, args, before, after, train_seconds, steps, plot_path) -> None:
    """Print before/after accuracy and samples; write them to results.json."""
    results = {
        "task": script.task,
        "steps": steps,
        "train_seconds": round(train_seconds, 1),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "tool_calls_before": before["tool_calls"],
        "tool_calls_after": after["tool_calls"],
        "torch_threads": torch.get_num_threads(),
    }
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(
            {**results, "samples_before": before["samples"], "samples_after": after["samples"]}, f, indent=1
        )
    print(f"\nHeld-out greedy accuracy ({script.num_test} {script.task} problems):")
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
    print(f"Plot: {plot_path}   adapter/model: {args.output_dir}   results: {args.output_dir}/results.json")


if __name__ == "__main__":
    main()
