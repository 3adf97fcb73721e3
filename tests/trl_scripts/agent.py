# A TRL 1.16 agent-training script: a tool function and an environment whose methods are tools and
# which owns part of the reward (get_reward). Run by tests/test_trl_scripts.py with the import line
# changed (trl -> grpo_hf); MODEL is a local checkpoint folder.
import json
import os

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


class Counter:
    def reset(self, **kwargs):
        self.count = 0

    def increment(self, step: int) -> int:
        """Adds `step` to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter after the addition.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count > 0)


dataset = Dataset.from_list(
    [{"prompt": [{"role": "user", "content": f"Multiply {i} by 3, then count to it."}]} for i in range(4)]
)


def used_a_tool(completions, **kwargs):
    return [float(any(m.get("role") == "tool" for m in c)) for c in completions]


trainer = GRPOTrainer(
    model=os.environ["MODEL"],
    reward_funcs=used_a_tool,
    args=GRPOConfig(
        output_dir=os.environ.get("OUTPUT_DIR", "agent-GRPO"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=24,
        max_tool_calling_iterations=2,
        max_steps=2,
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        report_to="none",
    ),
    train_dataset=dataset,
    tools=[multiply],
    environment_factory=Counter,
)
trainer.train()
print(json.dumps(trainer.state.log_history))
