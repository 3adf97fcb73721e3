# A TRL 1.16 GRPO script driven from the command line (HfArgumentParser over GRPOConfig), as users
# run `accelerate launch train.py --loss_type ... --scale_rewards False ...`. Run by
# tests/test_trl_scripts.py with the import line changed (trl -> grpo_hf).
import json
import os

from datasets import Dataset
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

(training_args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses()
dataset = Dataset.from_list([{"prompt": f"Count to {i}:"} for i in range(8)])


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) / 20 for completion in completions]


trainer = GRPOTrainer(
    model=os.environ["MODEL"], reward_funcs=reward_len, args=training_args, train_dataset=dataset
)
trainer.train()
print(json.dumps(trainer.state.log_history))
