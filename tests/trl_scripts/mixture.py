# A TRL 1.16 GRPO script in the shape of trl/scripts/grpo.py: TrlParser over (script arguments,
# GRPOConfig, ModelConfig, DatasetMixtureConfig), a mixture of local datasets from the YAML file
# (get_dataset: columns, fractions, a test split) or a dataset by name, a reward model and reward
# functions by name, full fine-tuning with get_quantization_config / get_peft_config (both None
# here), evaluation on the test split. Run by tests/test_trl_scripts.py with the import lines
# changed (trl -> grpo_hf), with mixture.yaml.
import json
from dataclasses import dataclass, field

from datasets import load_dataset
from trl import (
    DatasetMixtureConfig,
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
    init_zero_verbose,
)
from trl.rewards import accuracy_reward, get_soft_overlong_punishment

init_zero_verbose()


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A reward model to score with."}
    )
    reward_funcs: list[str] | None = field(default=None, metadata={"help": "Reward functions, by name."})


REWARDS = {
    "accuracy_reward": accuracy_reward,
    "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=4),
}


def main(script_args, training_args, model_args, dataset_args):
    reward_funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    reward_funcs += [REWARDS[name] for name in script_args.reward_funcs or []]

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")
    print(json.dumps({split: len(rows) for split, rows in dataset.items()}))

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    print(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    main(*parser.parse_args_and_config(fail_with_unknown_args=False))
