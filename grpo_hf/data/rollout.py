"""A round's prompts and completions as tensors (`Rollout`, and `ScoredRound` with its rewards).

Prompts are left-padded (and left-truncated to `max_prompt_length`), so every completion starts at
the same column. A completion's mask covers its tokens up to and including the first EOS; a
completion with no EOS within `max_completion_length` is flagged as truncated.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One batch of prompts and their sampled completions."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C) pad after the first EOS
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the first EOS
    truncated: torch.Tensor  # (B,) bool: no EOS within max_completion_length
    # (B, C) log-probs of the drawn tokens under the sampler's own distribution (after the logits
    # processors, on the generation copy), 0 after the first EOS; None when not recorded.
    sampler_logps: torch.Tensor | None = None
    # (B, C) 1 on tool-result tokens of a multi-turn completion (in the context, out of the loss);
    # None for single-turn rollouts.
    tool_mask: torch.Tensor | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (B, P + C)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # (B, P + C)

    @classmethod
    def from_tokens(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        sampler_logps: torch.Tensor | None,
        eos_token_ids: list[int],
        pad_token_id: int,
        ended: torch.Tensor | None = None,
    ) -> "Rollout":
        """The rollout of sampled (B, C) token rows: each completion up to and including its first EOS
        (ids after it -> pad, log-probs -> 0), truncated where no EOS came. `ended` (B, C): where a row
        really has tokens, for a row that stopped without an EOS (a finished regex); all by default."""
        mask, truncated = completion_mask_after_eos(completion_ids, eos_token_ids)  # (B, C), (B,)
        if ended is not None:
            mask = mask * ended  # (B, C)
        if sampler_logps is not None:
            sampler_logps = sampler_logps.masked_fill(mask == 0, 0.0)  # (B, C)
        completion_ids = completion_ids.masked_fill(mask == 0, pad_token_id)  # (B, C)
        return cls(prompt_ids, prompt_mask, completion_ids, mask, truncated, sampler_logps)

    @classmethod
    def empty(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> "Rollout":
        """The rollout of zero rows (a process with nothing to generate in a collective call)."""
        nothing = torch.zeros((0, 0), dtype=torch.long, device=prompt_ids.device)
        return cls(
            prompt_ids, prompt_mask, nothing, nothing, torch.zeros(0, dtype=torch.bool, device=nothing.device),
            torch.zeros((0, 0), device=nothing.device),
        )  # fmt: skip


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], chat_template_kwargs: dict | None = None
) -> str:
    """A prompt as text: plain text as is, chat messages through the tokenizer's chat template
    (with `chat_template_kwargs`, e.g. {"enable_thinking": False})."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


def message_text(value: str | list[dict]) -> str:
    """The text of a prompt or completion: a str as is, a chat's last message's content."""
    return value if isinstance(value, str) else value[-1]["content"]


def transcript(value: str | list[dict]) -> str:
    """A completion as one text for logs: a str as is, a one-message chat as its content, a
    multi-turn chat as its messages, each led by its role; tool calls as `<tool_call>` JSON."""
    if isinstance(value, str):
        return value
    if len(value) == 1:
        return _with_calls(value[0])
    return "\n".join(f"[{m['role']}] {_with_calls(m)}" for m in value)


def _with_calls(message: dict) -> str:
    calls = [
        f"<tool_call>{json.dumps(c['function'], default=str)}</tool_call>"
        for c in message.get("tool_calls") or []
    ]
    return " ".join([message["content"], *calls]).strip() if calls else message["content"]


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_prompt_length: int | None,
    device: torch.device,
    pad_to_multiple_of: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and mask, P a multiple of `pad_to_multiple_of` if set; over-long
    prompts keep their last tokens, with a warning.

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
    return left_padded(encoded, tokenizer.pad_token_id, device, pad_to_multiple_of)


def left_padded(
    rows: list[list[int]], pad_token_id: int, device: torch.device, multiple: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as (B, W) ids left-padded with `pad_token_id` and their (B, W) mask; W is the
    longest row (0 for none), rounded up to a multiple of `multiple` if given."""
    width = max((len(tokens) for tokens in rows), default=0)
    width = width if multiple is None else -(-width // multiple) * multiple
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        if tokens:
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = 1
    return ids.to(device), mask.to(device)


def right_padded(rows: list[list], fill: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lists of per-token values (ids, log-probs) as one (B, W) tensor, right-padded with `fill`."""
    width = max((len(row) for row in rows), default=0)
    padded = [list(row) + [fill] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=dtype, device=device).view(len(rows), width)  # (B, W), also B = 0


def eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    if not ids:
        raise ValueError(
            "Neither the tokenizer nor the model's generation_config has an eos token; set tokenizer.eos_token."
        )
    return sorted(ids)


def decode_completions(tokenizer: PreTrainedTokenizerBase, result: Rollout, chat: bool) -> list:
    """Completion texts; for chat prompts, each as a one-message assistant turn."""
    texts = tokenizer.batch_decode(result.completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": text}] for text in texts] if chat else texts


def sample_completions(
    prompts: list,
    tokenizer: PreTrainedTokenizerBase,
    generate: Callable[[torch.Tensor, torch.Tensor], Rollout],
    device: torch.device,
    max_prompt_length: int | None = None,
    chat_template_kwargs: dict | None = None,
    pad_to_multiple_of: int | None = None,
) -> tuple[Rollout, list]:
    """One completion per prompt (text or chat) from `generate(prompt_ids, prompt_mask)`: the prompts
    rendered (`chat_template_kwargs`), tokenized and left-padded (`max_prompt_length`,
    `pad_to_multiple_of`: `tokenize_prompts`), the completions decoded. Training and evaluation
    sample through it."""
    rendered = [render_prompt(tokenizer, p, chat_template_kwargs) for p in prompts]
    prompt_ids, prompt_mask = tokenize_prompts(
        tokenizer, rendered, max_prompt_length, device, pad_to_multiple_of
    )
    result = generate(prompt_ids, prompt_mask)
    return result, decode_completions(tokenizer, result, chat=not isinstance(prompts[0], str))


def completion_mask_after_eos(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) mask up to and including the first EOS, and (B,) truncated = no EOS at all."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # (B, C)
    eos_seen_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # (B, C) EOS count strictly before t
    mask = (eos_seen_before == 0).long()  # (B, C)
    truncated = ~is_eos.any(dim=1)  # (B,)
    return mask, truncated


@dataclass
class ScoredRound:
    """Completions of one generation pass with their rewards (one process's rows, or gathered)."""

    result: Rollout
    prompts: list
    completions: list
    rewards_per_func: torch.Tensor  # (N, F) NaN = does not apply
    errors: int  # completions scored 0 after a reward function raised (this process's)
    retried: int  # batches a reward function raised on but scored one by one (this process's)
    seconds: float  # generation time (this process's)
    extra_rows: list[dict]  # per row: the columns reward functions logged with log_extra
    logged_metrics: dict[str, list[float]]  # what reward functions logged with log_metric (this process's)
    episode_counts: list[int] | None = (
        None  # tool episodes' counts (`multi_turn.episode_counts`), not recorded yet
    )

    def state(self) -> dict:
        """Plain data (tensors, lists, dicts, str, numbers) for a checkpoint (`torch.load(...,
        weights_only=True)` reads it back); `from_state` rebuilds the round."""
        state = {field.name: getattr(self, field.name) for field in fields(self)}
        return state | {"result": asdict(self.result), "logged_metrics": dict(self.logged_metrics)}

    @classmethod
    def from_state(cls, state: dict) -> "ScoredRound":
        return cls(**{**state, "result": Rollout(**state["result"])})
