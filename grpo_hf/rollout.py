"""Prompts -> sampled completions, with the masks the loss needs.

Prompts are left-padded (and left-truncated to `max_prompt_length`), so every completion starts at
the same column. A completion's mask covers its tokens up to and including the first EOS; a
completion with no EOS within `max_completion_length` is flagged as truncated.
"""

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One batch of prompts and their sampled completions."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C) pad after the first EOS
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the first EOS
    truncated: torch.Tensor  # (B,) bool: no EOS within max_completion_length

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (B, P + C)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # (B, P + C)


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_prompt_length: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and mask; over-long prompts keep their last tokens, with a warning.

    Text is tokenized as is, without special tokens: a chat template's output already holds them,
    and a plain-text prompt that needs a BOS token should carry it.
    """
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None and any(len(ids) > max_prompt_length for ids in encoded):
        longest = max(len(ids) for ids in encoded)
        logger.warning(
            "A prompt has %d tokens > max_prompt_length=%d: keeping its last %d tokens. "
            "Raise max_prompt_length to keep whole prompts.",
            longest,
            max_prompt_length,
            max_prompt_length,
        )
        encoded = [ids[-max_prompt_length:] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, tokens in enumerate(encoded):
        if tokens:
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = 1
    return ids.to(device), mask.to(device)


def completion_mask_after_eos(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) mask up to and including the first EOS, and (B,) truncated = no EOS at all."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # (B, C)
    eos_seen_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # (B, C) EOS count strictly before t
    mask = (eos_seen_before == 0).long()  # (B, C)
    truncated = ~is_eos.any(dim=1)  # (B,)
    return mask, truncated


def generation_config(
    *,
    max_completion_length: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float | None,
    repetition_penalty: float,
    pad_token_id: int,
    eos_token_ids: list[int],
) -> GenerationConfig:
    """The sampling settings of a GRPO rollout as a `GenerationConfig`."""
    return GenerationConfig(
        do_sample=True,
        max_new_tokens=max_completion_length,
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids,
    )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
) -> Rollout:
    """Sample one completion per prompt row (rows are already repeated G times)."""
    was_training = model.training
    model.eval()
    try:
        sequences = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
        )  # (B, P + C)
    finally:
        model.train(was_training)
    completion_ids = sequences[:, prompt_ids.shape[1] :]  # (B, C)
    eos_ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    mask, truncated = completion_mask_after_eos(completion_ids, eos_ids)
    completion_ids = completion_ids.masked_fill(mask == 0, config.pad_token_id)
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)
