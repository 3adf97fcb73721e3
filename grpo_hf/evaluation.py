"""Greedy accuracy on a held-out split: the before / after number of a training run.

With `tools`, each prompt is a greedy multi-turn episode (`multi_turn`), as in training.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from datasets import Dataset
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from grpo_hf.data import rollout
from grpo_hf.engine import local
from grpo_hf.episodes.multi_turn import tool_episodes
from grpo_hf.episodes.tools import Toolbox
from grpo_hf.rewards.async_rewards import blocking, is_async_reward
from grpo_hf.rewards.scoring import RewardFunc, reward_name


@dataclass
class EvalResult:
    """Mean reward of greedy completions, and the first few (question, completion, reward) rows.

    The question is the prompt's text (for chat prompts, its last message).
    """

    accuracy: float
    samples: list[tuple[str, str, float]]
    tool_calls_per_episode: float | None = None  # with tools


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
    tools: list[Callable] | None = None,
    max_tool_calling_iterations: int | None = None,
    tool_timeout: float = 10.0,
) -> EvalResult:
    """Greedy-decode every prompt of `dataset` and average `reward_func` over the completions.

    With `tools`, `max_new_tokens` is each episode's whole budget (model and tool tokens)."""
    device = next(model.parameters()).device
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=rollout.eos_token_ids(model, tokenizer),
    )
    if is_async_reward(reward_func):
        reward_func = blocking(reward_func, reward_name(reward_func))
    toolbox = Toolbox(tools) if tools else None
    scores, samples, calls = [], [], []
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        if toolbox is None:
            _, completions = rollout.sample_completions(
                rows["prompt"], tokenizer, lambda ids, mask: local.generate(model, ids, mask, config), device
            )
        else:
            _, completions, episodes = tool_episodes(
                rows["prompt"],
                toolbox.for_episodes(None, len(rows["prompt"])),
                [toolbox.schemas[None]] * len(rows["prompt"]),
                tokenizer,
                lambda ids, mask, n: local.generate(model, ids, mask, _with_max_new_tokens(config, n)),
                max_prompt_length=None,
                max_iterations=max_tool_calling_iterations,
                max_completion_length=max_new_tokens,
                timeout=tool_timeout,
                device=device,
            )
            calls += [e.tool_calls for e in episodes]
        columns = {k: v for k, v in rows.items() if k != "prompt"}
        rewards = reward_func(prompts=rows["prompt"], completions=completions, completion_ids=None, **columns)
        batch_scores = [0.0 if r is None else float(r) for r in rewards]  # None: does not apply, scores 0
        scores.extend(batch_scores)
        for prompt, completion, score in zip(rows["prompt"], completions, batch_scores, strict=True):
            if len(samples) < num_samples:
                samples.append((rollout.message_text(prompt), rollout.transcript(completion), score))
    return EvalResult(sum(scores) / max(len(scores), 1), samples, sum(calls) / len(calls) if calls else None)


def _with_max_new_tokens(config: GenerationConfig, max_new_tokens: int) -> GenerationConfig:
    config = copy.deepcopy(config)
    config.max_new_tokens = max_new_tokens
    return config
