"""`make train`'s recipe trained by TRL's GRPOTrainer instead of ours: same settings, model, data, rewards.

    python bench/trl_recipe.py --config recipes/configs/smollm2_lora_arithmetic.yaml [--any_setting value ...]

The run is read with the recipe's own parser (`grpo_hf_cli.grpo`, the script recipes/grpo.py runs). TRL's GRPOConfig gets every setting
the run changed from our GRPOConfig's defaults that TRL's config also has, and the precision and
device ours resolved (`bf16`, `use_cpu`); TRL's trainer gets the recipe's LoRA, the task's train split, reward functions
and tools, and the same model folder. The settings TRL has no field for are printed: they do not
reach TRL. Trains and saves (checkpoints as the settings say); no evaluation here:
`bench/learning_curve.py --trainer trl` runs this and scores the checkpoints as it scores ours.
Needs TRL (`pip install -e ".[bench]"`).
"""

import dataclasses
import sys

from grpo_hf import GRPOConfig, get_peft_config
from grpo_hf.models.loading import DEFAULT_MODEL, resolve_model_path
from grpo_hf.tasks import TASKS
from grpo_hf_cli import grpo as script

# Ours derives these from other settings; TRL derives them the same way from what it is given
# (it refuses generation_batch_size beside steps_per_generation).
DERIVED = {"generation_batch_size", "activation_checkpointing", "dataloader_pin_memory"}


def trl_settings(config: GRPOConfig, trl_fields: set[str]) -> tuple[dict, list[str]]:
    """(what to give TRL's GRPOConfig, the changed settings TRL has no field for)."""
    defaults = type(config)(output_dir=config.output_dir)
    changed = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.init and f.name not in DERIVED and getattr(config, f.name) != getattr(defaults, f.name)
    }
    given = {name: value for name, value in changed.items() if name in trl_fields}
    given["output_dir"] = config.output_dir
    # What precision (ours only) resolved to, and the device ours resolved: use_cpu where torch sees no
    # accelerator or for bf16 on a CPU, which TRL, given bf16 alone, would not set (TRL's bf16 default
    # differs as well).
    given["bf16"], given["use_cpu"] = config.bf16, config.use_cpu
    return given, sorted(set(changed) - trl_fields - {"precision"})


def main(argv: list[str] | None = None) -> None:
    from trl import GRPOConfig as TrlGRPOConfig
    from trl import GRPOTrainer as TrlGRPOTrainer

    run, config, model_args, mixture = script.parse(argv)
    trl_fields = {f.name for f in dataclasses.fields(TrlGRPOConfig) if f.init}
    given, missing = trl_settings(config, trl_fields)
    print(f"TRL gets: {given}\nTRL has no field for (not applied): {missing}", flush=True)
    task, data = TASKS[run.task], script.load_data(run, config, mixture)
    tools = {"tools": task.tools} if task.tools else {}
    trainer = TrlGRPOTrainer(
        model=resolve_model_path(model_args.model_name_or_path or DEFAULT_MODEL),
        reward_funcs=task.rewards,
        args=TrlGRPOConfig(**given),
        train_dataset=data["train"],
        peft_config=get_peft_config(model_args),
        **tools,
    )
    trainer.train()
    trainer.save_model(config.output_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
