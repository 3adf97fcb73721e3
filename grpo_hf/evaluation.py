"""Greedy accuracy on a held-out split: the before / after number of a training run."""

from dataclasses import dataclass

import torch
from datasets import Dataset
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from grpo_hf import rollout
from grpo_hf.async_rewards import blocking, is_async_reward
from grpo_hf.scoring import RewardFunc, reward_name


@dataclass
class EvalResult:
    """Mean reward of greedy completions, and the first few (question, completion, reward) rows.

    The question is the prompt's text (for chat prompts, its last message).
    """

    accuracy: float
    samples: list[tuple[str, str, float]]


@torch.no_grad()
def greedy_accuracy(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Dataset,
    reward_func: RewardFunc,
    *,
    batch_size: int = 64,
    max_new_tokens: int = 32,
    num_samples: int = 4,
) -> EvalResult:
    """Greedy-decode every prompt of `dataset` and average `reward_func` over the completions."""
    device = next(model.parameters()).device
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=rollout.eos_token_ids(model, tokenizer),
    )
    if is_async_reward(reward_func):
        reward_func = blocking(reward_func, reward_name(reward_func))
    scores, samples = [], []
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        texts = [rollout.render_prompt(tokenizer, p) for p in rows["prompt"]]
        ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, device)
        result = rollout.generate(model, ids, mask, config)
        completions = rollout.decode_completions(
            tokenizer, result, chat=not isinstance(rows["prompt"][0], str)
        )
        columns = {k: v for k, v in rows.items() if k != "prompt"}
        rewards = reward_func(prompts=rows["prompt"], completions=completions, completion_ids=None, **columns)
        batch_scores = [0.0 if r is None else float(r) for r in rewards]  # None: does not apply, scores 0
        scores.extend(batch_scores)
        for prompt, completion, score in zip(rows["prompt"], completions, batch_scores, strict=True):
            if len(samples) < num_samples:
                samples.append((rollout.message_text(prompt), rollout.message_text(completion), score))
    return EvalResult(sum(scores) / max(len(scores), 1), samples)
