"""Greedy accuracy on a held-out split: the before / after number of a training run."""

from dataclasses import dataclass

import torch
from datasets import Dataset
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from grpo_hf import rollout
from grpo_hf.scoring import RewardFunc


@dataclass
class EvalResult:
    """Mean reward of greedy completions, and the first few (prompt, completion, reward) rows."""

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
    eos_ids = sorted({tokenizer.eos_token_id, *_as_list(model.generation_config.eos_token_id)} - {None})
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids
    )
    scores, samples = [], []
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        texts = [rollout.render_prompt(tokenizer, p) for p in rows["prompt"]]
        ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, device)
        result = rollout.generate(model, ids, mask, config)
        completions = tokenizer.batch_decode(result.completion_ids, skip_special_tokens=True)
        if not isinstance(rows["prompt"][0], str):
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = {k: v for k, v in rows.items() if k != "prompt"}
        rewards = reward_func(prompts=rows["prompt"], completions=completions, completion_ids=None, **columns)
        scores.extend(0.0 if r is None else float(r) for r in rewards)
        for prompt, completion, reward in zip(texts, completions, rewards, strict=True):
            if len(samples) < num_samples:
                text = completion if isinstance(completion, str) else completion[0]["content"]
                samples.append((prompt, text, reward))
    return EvalResult(sum(scores) / max(len(scores), 1), samples)


def _as_list(value: int | list[int] | None) -> list[int | None]:
    return value if isinstance(value, list) else [value]
