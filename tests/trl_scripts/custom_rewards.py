# A TRL 1.16 GRPO script using many GRPOConfig settings and the reward-function forms TRL documents
# (token-count, character-count, regex format, ground-truth column, multi-task None, async,
# log_extra / log_metric, trainer_state). Run by tests/test_trl_scripts.py with the import lines
# changed (trl -> grpo_hf); MODEL is a local checkpoint folder.
import asyncio
import json
import os
import re

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

rows = []
for i in range(4):
    rows.append(
        {"prompt": f"Problem: what is {i} + {i}? Solution:", "ground_truth": str(2 * i), "task": "math"}
    )
    rows.append({"prompt": f"Write a function returning {i}.", "ground_truth": str(i), "task": "code"})
dataset = Dataset.from_list(rows)


def token_count_reward(completion_ids, **kwargs):
    return [float(len(ids)) / 100 for ids in completion_ids]


def char_count_reward(completions, **kwargs):
    return [float(len(completion)) / 1000 for completion in completions]


def format_reward(completions, **kwargs):
    return [1.0 if re.match(r"^<think>.*?</think><answer>.*?</answer>$", c) else 0.0 for c in completions]


def boxed_reward(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in found]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth, strict=True)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def math_only_reward(prompts, completions, task, **kwargs):
    return [
        float(str(i) in c) if t == "math" else None
        for i, (c, t) in enumerate(zip(completions, task, strict=True))
    ]


async def async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


def curriculum_reward(completions, trainer_state, **kwargs):
    scale = min(1.0, (trainer_state.global_step + 1) / 4)
    return [scale * len(set(c)) / 100 for c in completions]


training_args = GRPOConfig(
    output_dir=os.environ.get("OUTPUT_DIR", "custom-rewards-GRPO"),
    per_device_train_batch_size=8,
    num_generations=4,
    gradient_accumulation_steps=2,
    max_completion_length=16,
    max_steps=2,
    learning_rate=1e-3,
    logging_steps=1,
    beta=0.001,
    epsilon=0.2,
    epsilon_high=0.28,
    num_iterations=2,
    loss_type="dr_grpo",
    scale_rewards=False,
    mask_truncated_completions=True,
    multi_objective_aggregation="normalize_then_sum",
    reward_weights=[0.5, 0.5, 1.0, 1.0, 1.0, 0.5, 0.5],
    top_entropy_quantile=0.5,
    use_bias_correction_kl=True,
    temperature=0.9,
    top_p=0.95,
    log_completions=True,
    num_completions_to_print=2,
    gradient_checkpointing=False,
    bf16=False,
    report_to="none",
)
trainer = GRPOTrainer(
    model=os.environ["MODEL"],
    reward_funcs=[
        token_count_reward,
        char_count_reward,
        format_reward,
        boxed_reward,
        math_only_reward,
        async_reward,
        curriculum_reward,
    ],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
print(json.dumps(trainer.state.log_history))
