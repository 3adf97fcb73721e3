"""The GRPO script: TRL 1.16's `trl grpo` on grpo-hf's trainer, and grpo-hf's built-in tasks.

    grpo-hf grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name my.jsonl \\
        --reward_funcs accuracy_reward --use_peft --output_dir out
    accelerate launch recipes/grpo.py --config recipes/configs/smollm2_lora_arithmetic.yaml

It parses TRL's four dataclasses, `(GRPOScriptArguments, GRPOConfig, ModelConfig,
DatasetMixtureConfig)`, with `TrlParser` (a `--config` YAML file gives defaults, flags override it)
and trains as `trl/scripts/grpo.py` does: the dataset from `--dataset_name` (a Hub id, a local
folder, or here also a local JSON / JSONL / CSV / parquet file) or a YAML `datasets:` mixture, the
reward model and reward functions named, the model by name with `ModelConfig`'s dtype, attention,
revision, LoRA and quantization; then save (and push with `--push_to_hub`), the model card naming the
dataset as TRL's does.

Departures from TRL's script, each stated: `--task` trains on a built-in task instead (its data,
its rewards plus any named, and its held-out greedy accuracy before and after training, a plot and
results.json); without `--model_name_or_path` the embedded default model trains (TRL's stops);
`--merge_adapter` also saves the LoRA merged into the weights; a run with nothing to train on or no
reward is refused while parsing, before anything loads.
"""

import gc
import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar

from accelerate import PartialState
from accelerate.utils import DistributedType
from datasets import DatasetDict

from grpo_hf import (
    DatasetMixtureConfig,
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)
from grpo_hf.models.loading import DEFAULT_MODEL, check_reward_model_path, resolve_model_path
from grpo_hf.script_utils import load_script_dataset
from grpo_hf.tasks import TASKS
from grpo_hf_cli import task_report
from grpo_hf_cli.rewards import REWARD_FUNCS, check_reward_names, reward_funcs

# Set by `grpo-hf grpo` for the processes it launches: the YAML file's keys that no dataclass has were
# accelerate launch's settings, already handed to `accelerate launch` (see `grpo_hf_cli.launch`).
LAUNCHED_BY_CLI = "GRPO_HF_LAUNCHED_BY_CLI"


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """TRL's `GRPOScriptArguments` (the reward model and functions), and the built-in tasks."""

    _help_section: ClassVar[tuple[str, str]] = (
        "script",
        "script: rewards, or a built-in task and its evaluation",
    )

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A reward model (a sequence classifier with one output): a Hub id or a local folder. It is "
            "the first reward, before --reward_funcs."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Reward functions by name: {', '.join(REWARD_FUNCS)} (TRL's meaning where TRL has the name), "
            "or a dotted import path (module.function) found from the working directory."
        },
    )
    task: str | None = field(
        default=None,
        metadata={
            "help": f"A built-in task instead of a dataset: one of {sorted(TASKS)}. It brings its data and rewards "
            "(--reward_funcs add to them) and reports held-out greedy accuracy before and after training "
            "(results.json, training.png in output_dir)."
        },
    )
    num_train: int = field(default=2000, metadata={"help": "--task: training problems to generate."})
    num_test: int = field(default=200, metadata={"help": "--task: held-out problems for greedy accuracy."})
    eval_max_new_tokens: int = field(
        default=32, metadata={"help": "--task: completion length of the greedy evaluation."}
    )
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "With --use_peft: also save the LoRA merged into the weights (merged/)."},
    )


Parsed = tuple[GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig]


def make_parser(prog: str | None = None) -> TrlParser:
    """The script's parser, over TRL's four dataclasses in TRL's order."""
    return TrlParser(
        (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description="Train a model with GRPO (grpo-hf): on a dataset (--dataset_name, or a datasets: mixture in "
        "--config) with --reward_funcs and / or --reward_model_name_or_path, or on a built-in --task. Settings "
        "come from --config FILE.yaml and flags; a flag wins over the file.",
    )


def check_settings(
    script: GRPOScriptArguments, args: GRPOConfig, model: ModelConfig, data: DatasetMixtureConfig
) -> None:
    """What to train on and with which rewards, checked before anything loads."""
    if script.task is not None:
        if script.task not in TASKS:
            raise ValueError(f"task={script.task!r} is not one of {sorted(TASKS)}.")
        if script.dataset_name or data.datasets:
            raise ValueError("--task brings its own data: drop --dataset_name / datasets, or drop --task.")
    elif not (script.dataset_name or data.datasets):
        raise ValueError(
            "Nothing to train on: give --dataset_name (a Hub id, or a local JSON / JSONL / CSV / parquet file or "
            f"folder), a datasets: mixture in --config, or a built-in --task ({', '.join(sorted(TASKS))})."
        )
    elif not (script.reward_funcs or script.reward_model_name_or_path):
        raise ValueError(
            f"No reward: give --reward_funcs (e.g. accuracy_reward; {len(REWARD_FUNCS)} names, or module.function) "
            "and / or --reward_model_name_or_path."
        )
    check_reward_names(script.reward_funcs or [])
    # A bad model name fails here, in seconds; the built-in default is left to download when training.
    if model.model_name_or_path not in (None, DEFAULT_MODEL):
        resolve_model_path(model.model_name_or_path)
    if script.reward_model_name_or_path:
        check_reward_model_path(script.reward_model_name_or_path)
    if script.merge_adapter and not model.use_peft:
        raise ValueError("--merge_adapter merges a LoRA adapter: it needs --use_peft.")


def parse(argv: list[str] | None = None, prog: str | None = None) -> Parsed:
    """The settings of a run, checked; a mistake exits with one line naming it."""
    parser = make_parser(prog)
    launched = os.environ.get(LAUNCHED_BY_CLI) == "1"
    try:
        parsed = parser.parse_args_and_config(argv, fail_with_unknown_args=not launched)
        check_settings(*parsed)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    return parsed


def load_data(script: GRPOScriptArguments, args: GRPOConfig, data: DatasetMixtureConfig) -> DatasetDict:
    """The training (and, with evaluation on, test) split: the task's, the mixture's or dataset_name's."""
    if script.task is not None:
        return TASKS[script.task].build(num_train=script.num_train, num_test=script.num_test, seed=args.seed)
    dataset = get_dataset(data) if data.datasets else load_script_dataset(script)
    wanted = [script.dataset_train_split] + [script.dataset_test_split] * (args.eval_strategy != "no")
    if missing := [split for split in wanted if split not in dataset]:
        raise ValueError(
            f"The dataset has no split {missing[0]!r} (its splits: {list(dataset)}); set --dataset_train_split / "
            "--dataset_test_split, or turn evaluation off (--eval_strategy no)."
        )
    return dataset


def main(
    script: GRPOScriptArguments, args: GRPOConfig, model_args: ModelConfig, data: DatasetMixtureConfig
) -> None:
    """Train and save; with --task, evaluate before and after and report on the main process."""
    state = PartialState()
    if script.merge_adapter and state.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ValueError(
            "merge_adapter needs the whole model in one process; under FSDP or DeepSpeed, train without it and "
            "merge the saved adapter afterwards (PeftModel.from_pretrained(base, output_dir).merge_and_unload())."
        )
    task = TASKS[script.task] if script.task else None
    rewards = ([script.reward_model_name_or_path] if script.reward_model_name_or_path else []) + reward_funcs(
        script.reward_funcs or [], args
    )
    dataset = load_data(script, args, data)
    # As TRL's script: ModelConfig's loading settings, under any model_init_kwargs the config gives.
    args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    } | (args.model_init_kwargs or {})
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path or DEFAULT_MODEL,
        reward_funcs=(task.rewards if task else []) + rewards,
        args=args,
        train_dataset=dataset[script.dataset_train_split],
        eval_dataset=dataset[script.dataset_test_split] if args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        tools=task.tools if task and task.tools else None,
    )
    trainer.model_card.dataset_name = script.dataset_name  # every card of the run names it (TRL)
    before = (
        task_report.evaluate(trainer, dataset["test"], task, script.eval_max_new_tokens) if task else None
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - start
    trainer.save_model(args.output_dir)
    trainer.accelerator.print(f"Model saved to {args.output_dir}.")
    after = task_report.evaluate(trainer, dataset["test"], task, script.eval_max_new_tokens) if task else None
    if args.push_to_hub:  # every process: it saves the model again
        trainer.push_to_hub(dataset_name=script.dataset_name)
    if state.is_main_process and script.merge_adapter:  # last: merging takes the adapter out of the policy
        merged_dir = os.path.join(args.output_dir, "merged")
        trainer.accelerator.unwrap_model(trainer.model).merge_and_unload().save_pretrained(merged_dir)
        trainer.processing_class.save_pretrained(merged_dir)
    if state.is_main_process and task:
        task_report.report(script.task, script.num_test, trainer, before, after, train_seconds)


def import_deepspeed_first() -> None:
    """In a run of several processes, import DeepSpeed (where installed) before the process group exists.

    DeepSpeed's `comm.torch.TorchBackend` binds the world process group as a default argument when
    it is imported (`barrier(self, group=GroupMember.WORLD, ...)`); Accelerate imports it while the
    trainer is built, after the group exists, and then those defaults keep the group alive. Imported
    first, they hold None.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401


def run(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Parse `argv` (else `sys.argv[1:]`), train, and take the process group down.

    The group must be freed before the interpreter exits: its gloo threads, left running into exit,
    aborted about one two-process run in 20 on 2 busy cores after it had trained and saved (SIGABRT,
    "terminate called without an active exception", when a thread freed a finished collective's
    tensors). So nothing may hold it past `destroy_process_group`: DeepSpeed is imported before it
    exists (`import_deepspeed_first`), and the trainer's reference cycles (its DDP-wrapped model
    holds the group) are collected first.
    """
    import_deepspeed_first()  # parsing GRPOConfig starts the process group
    main(*parse(argv, prog))
    gc.collect()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    run(prog="grpo-hf grpo")
