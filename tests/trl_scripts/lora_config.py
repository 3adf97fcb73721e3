# A TRL 1.16 GRPO script in the shape of TRL's example scripts (trl/scripts/grpo.py,
# examples/scripts/grpo_*.py): TrlParser over (script arguments, GRPOConfig, ModelConfig) with a YAML
# --config and command-line overrides, the dataset named by the script arguments, reward functions
# chosen by name (trl.rewards, or a dotted import path), LoRA from get_peft_config. Run by
# tests/test_trl_scripts.py with the import lines changed (trl -> grpo_hf), with lora_config.yaml.
import importlib
import json
import os
import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config
from trl.rewards import accuracy_reward, think_format_reward

REWARDS = {"accuracy_reward": accuracy_reward, "think_format_reward": think_format_reward}


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy_reward"],
        metadata={
            "help": f"Reward functions: {sorted(REWARDS)} or a dotted import path ('module.function')."
        },
    )


def reward_function(name):
    if name in REWARDS:
        return REWARDS[name]
    if "." not in name:
        raise ValueError(
            f"Unknown reward function {name!r}: use one of {sorted(REWARDS)} or module.function."
        )
    module, function = name.rsplit(".", 1)
    sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), function)


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()

    training_args.model_init_kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[reward_function(name) for name in script_args.reward_funcs],
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    print(json.dumps(trainer.state.log_history))
