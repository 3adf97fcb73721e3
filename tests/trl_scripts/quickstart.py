# A TRL 1.16 GRPO script in the shape of TRL's quick start: the model, a reward from trl.rewards, a
# dataset, default settings. tests/test_trl_scripts.py runs it with only the import lines changed
# (trl -> grpo_hf); MODEL is a local checkpoint folder (no hub here), which TRL loads the same way.
import os

from datasets import Dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = Dataset.from_list(
    [
        {
            "prompt": [{"role": "user", "content": "What is 2 + 3? Put the answer in \\boxed{}."}],
            "solution": "5",
        },
        {
            "prompt": [{"role": "user", "content": "What is 7 - 4? Put the answer in \\boxed{}."}],
            "solution": "3",
        },
    ]
)

trainer = GRPOTrainer(
    model=os.environ["MODEL"],
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
