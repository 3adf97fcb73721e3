"""Prompts -> sampled completions, with the masks the loss needs.

Prompts are left-padded (and left-truncated to `max_prompt_length`), so every completion starts at
the same column. A completion's mask covers its tokens up to and including the first EOS; a
completion with no EOS within `max_completion_length` is flagged as truncated.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from grpo_hf.engine.decoding import decoder_for

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
    args,
    device: torch.device,
) -> tuple[Rollout, list]:
    """One completion per prompt (text or chat) from `generate(prompt_ids, prompt_mask)`: the prompts
    rendered, tokenized and left-padded as a `GRPOConfig` says, the completions decoded."""
    rendered = [render_prompt(tokenizer, p, args.chat_template_kwargs) for p in prompts]
    prompt_ids, prompt_mask = tokenize_prompts(
        tokenizer, rendered, args.max_prompt_length, device, args.pad_to_multiple_of
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
    generation_kwargs: dict | None = None,
) -> GenerationConfig:
    """The sampling settings of a GRPO rollout as a `GenerationConfig`; `generation_kwargs` (TRL's
    setting: more GenerationConfig keys) override them where they clash.

    Every knob is explicit (top_k 0 and min_p 0.0 mean off): handed to `model.generate`, a None
    would take transformers' default (top_k 50) or the model's own generation_config instead.
    """
    settings = dict(
        do_sample=True,
        max_new_tokens=max_completion_length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p or 0.0,
        repetition_penalty=repetition_penalty,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids,
        disable_compile=True,  # as TRL: no torch.compile of the model inside a training run
    )
    return GenerationConfig(**(settings | (generation_kwargs or {})))


# GenerationConfig keys our decoding loop honours (`logits_processors` and the loop's own); any
# other key in generation_kwargs (num_beams, stop_strings, ...) needs transformers' `generate`.
DECODER_KEYS = frozenset(
    {
        "do_sample", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p",
        "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
        "suppress_tokens", "min_new_tokens", "pad_token_id", "eos_token_id", "bos_token_id", "use_cache",
        "disable_compile",
    }
)  # fmt: skip


def logits_processors(
    config: GenerationConfig, prompt_width: int = 0, device: torch.device | str = "cpu"
) -> LogitsProcessorList:
    """The config's sampling knobs, applied in `generate`'s order: penalties and token bans, then
    the warpers. `prompt_width`: the (left-padded) prompt columns of the sequences the processors see."""
    processors = LogitsProcessorList()
    eos = config.eos_token_id
    # Unset knobs are None in a GenerationConfig; None and the neutral value both mean "off".
    if config.repetition_penalty not in (None, 1.0):
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_width, config.min_new_tokens, eos))
    if config.suppress_tokens is not None:
        processors.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    if not config.do_sample:
        return processors
    if config.temperature not in (None, 1.0):
        processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p not in (None, 1.0):
        processors.append(TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p))
    if config.typical_p not in (None, 1.0):
        processors.append(TypicalLogitsWarper(mass=config.typical_p))
    if config.epsilon_cutoff:
        processors.append(EpsilonLogitsWarper(epsilon=config.epsilon_cutoff))
    if config.eta_cutoff:
        processors.append(EtaLogitsWarper(epsilon=config.eta_cutoff, device=device))
    return processors


SAMPLING_BLOCK = 256


def sample_tokens(scores: torch.Tensor, block: int = SAMPLING_BLOCK) -> torch.Tensor:
    """One token per row from softmax(scores), by inverting the CDF with one uniform number per row.

    `torch.multinomial` (or an exponential race, argmax p / E) draws a random number per vocabulary
    entry: 17 ms for 16 rows of a 49k vocabulary on a CPU, against 1 ms here, at every decoding
    step. The CDF is built in two levels so that float32 rounding stays within a block: cumulative
    sums inside blocks of `block` tokens in float32, then across the blocks' totals in float64. A
    token of probability 0 has an empty interval and is never drawn.
    """
    probs = torch.softmax(scores.float(), dim=-1)  # (B, V)
    rows, vocab = probs.shape
    padded = torch.nn.functional.pad(probs, (0, -vocab % block))  # (B, K * block) zeros at the end
    within = padded.view(rows, -1, block).cumsum(dim=-1)  # (B, K, block) float32
    ends = within[:, :, -1].double().cumsum(dim=-1)  # (B, K) float64: CDF at each block's end
    starts = torch.nn.functional.pad(ends[:, :-1], (1, 0))  # (B, K) CDF before each block
    u = torch.rand(rows, 1, dtype=torch.float64, device=probs.device) * ends[:, -1:]  # (B, 1)
    k = torch.searchsorted(ends, u, right=True).clamp_(max=ends.shape[1] - 1)  # (B, 1) block index
    # starts + within[k] reproduces ends[k] exactly (the same float64 sum), so u < its last entry.
    cdf = (
        starts.gather(1, k) + within[torch.arange(rows, device=probs.device), k.squeeze(1)].double()
    )  # (B, block)
    j = torch.searchsorted(cdf, u, right=True).clamp_(max=block - 1)  # (B, 1)
    return (k * block + j).squeeze(1)  # (B,)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
    backend: str = "auto",
    all_done: Callable[[bool], bool] | None = None,
) -> Rollout:
    """One completion per prompt row (rows are already repeated G times), with a KV cache.

    Each distinct prompt is prefilled once and its cache shared by its copies; decoding stops as
    soon as every row has produced an EOS. Sampling uses the same logits processors as
    `model.generate`, so the knobs mean what they mean there. `backend` picks the decoder
    (`engine.decoding.decoder_for`). `all_done` (processes in lockstep, see
    `sharding.unsharded_for_generation`) is asked at every step whether every process is done;
    until then a process whose rows are done goes on running its model on a spare row.
    """
    was_training = model.training
    model.eval()
    try:
        completion_ids, sampler_logps = _decode(
            model, prompt_ids, prompt_mask, config, backend, all_done
        )  # (B, C) each
    finally:
        model.train(was_training)
    eos_ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    mask, truncated = completion_mask_after_eos(completion_ids, eos_ids)
    completion_ids = completion_ids.masked_fill(mask == 0, config.pad_token_id)
    sampler_logps = sampler_logps.masked_fill(mask == 0, 0.0)
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated, sampler_logps)


def _decode(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
    backend: str,
    all_done: Callable[[bool], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling loop; returns (B, C) new tokens, C <= max_new_tokens, and their (B, C) float32
    log-probs under the distribution they were drawn from (free here: the scores are at hand).

    A row that has drawn an EOS leaves the decoder (`keep`): later steps run only the rows still
    going, so a round costs what its completions' lengths add up to rather than rows times the
    longest. Its later columns hold `pad_token_id` and log-prob 0. With `all_done`, a process whose
    rows are all done keeps one of them in the decoder, fed its last token, until every process is.
    """
    decoder = decoder_for(model, config.max_new_tokens, backend)
    logits = decoder.prefill(prompt_ids, prompt_mask)  # (B, V)
    processors = logits_processors(config, prompt_ids.shape[1], prompt_ids.device)
    eos = torch.tensor(
        config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id],
        device=prompt_ids.device,
    )
    rows, device = prompt_ids.shape[0], prompt_ids.device
    new_tokens = torch.full(
        (rows, config.max_new_tokens), config.pad_token_id, dtype=torch.long, device=device
    )
    new_logps = torch.zeros((rows, config.max_new_tokens), device=device)
    going = torch.arange(rows, device=device)  # the decoder's rows, as rows of the batch
    sequence = prompt_ids  # (R, P + t) of the rows still going
    done = False
    for step in range(config.max_new_tokens):
        if not done:
            scores = processors(sequence, logits)  # (R, V)
            token = sample_tokens(scores) if config.do_sample else scores.argmax(dim=-1)  # (R,)
            new_tokens[going, step] = token
            new_logps[going, step] = (
                torch.log_softmax(scores.float(), dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)
            )
            open_rows = (~torch.isin(token, eos)).nonzero().squeeze(1)  # (R',)
            if open_rows.numel() == 0:
                done = True
                open_rows = open_rows.new_zeros(1)  # a spare row for lockstep decoding (all_done)
        if step + 1 == config.max_new_tokens or (all_done(done) if all_done else done):
            break
        if open_rows.numel() < going.numel():
            decoder.keep(open_rows)
            going, sequence, token = going[open_rows], sequence[open_rows], token[open_rows]
        if not done:
            sequence = torch.cat([sequence, token.unsqueeze(1)], dim=1)  # (R', P + t)
        logits = decoder(token)  # (R', V)
    return new_tokens[:, : step + 1], new_logps[:, : step + 1]  # (B, C), (B, C)
