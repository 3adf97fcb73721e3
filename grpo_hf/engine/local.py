"""Generation in the training process: `LocalGenerator` and our decoding loop.

`generate` samples one completion per prompt row with a KV cache through the decoder
`decoding.decoder_for` picks, applying the same logits processors as transformers' `generate` (so
the knobs mean what they mean there) and recording the sampler's log-probs of the drawn tokens.
`LocalGenerator` runs it on the policy or its `GenerationCopy`, or hands the call to transformers'
own engines (`transformers_generate`) for what the loop does not do.
"""

from collections.abc import Callable

import torch
from accelerate import Accelerator
from torch import nn
from transformers import GenerationConfig
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

from grpo_hf.data.rollout import Rollout
from grpo_hf.engine import fixed_shape, transformers_generate
from grpo_hf.engine.decoding import FIXED_SHAPE_DECODERS, decoder_for
from grpo_hf.engine.generation import Generator, Sampling
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.models.sharding import unsharded_for_generation


def generation_config(sampling: Sampling) -> GenerationConfig:
    """A call's `Sampling` as a transformers `GenerationConfig` (our decoder, generate, continuous
    batching); `generation_kwargs` (TRL's setting: more GenerationConfig keys) override the rest.

    Every knob is explicit (top_k 0 and min_p 0.0 mean off): handed to `model.generate`, a None
    would take transformers' default (top_k 50) or the model's own generation_config instead.
    """
    settings = dict(
        do_sample=True,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p or 0.0,
        repetition_penalty=sampling.repetition_penalty,
        pad_token_id=sampling.pad_token_id,
        eos_token_id=sampling.eos_token_ids,
        disable_compile=True,  # as TRL: no torch.compile of the model inside a training run
    )
    return GenerationConfig(**(settings | sampling.generation_kwargs))


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


def sample_tokens(
    scores: torch.Tensor, block: int = SAMPLING_BLOCK, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row from softmax(scores), by inverting the CDF with one uniform number per row
    (`uniforms`, (B, 1) float64 in [0, 1); drawn here when None).

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
    if uniforms is None:
        uniforms = torch.rand(rows, 1, dtype=torch.float64, device=probs.device)  # (B, 1)
    u = uniforms * ends[:, -1:]  # (B, 1)
    k = torch.searchsorted(ends, u, right=True).clamp_(max=ends.shape[1] - 1)  # (B, 1) block index
    # starts + within[k] reproduces ends[k] exactly (the same float64 sum), so u < its last entry.
    cdf = (
        starts.gather(1, k) + within[torch.arange(rows, device=probs.device), k.squeeze(1)].double()
    )  # (B, block)
    j = torch.searchsorted(cdf, u, right=True).clamp_(max=block - 1)  # (B, 1)
    return (k * block + j).squeeze(1)  # (B,)


def next_tokens(
    processors: LogitsProcessorList,
    sequence: torch.Tensor,
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token and its log-prob under the distribution it was drawn from: the
    processors' scores of the (R, V) logits, sampled with (R, 1) `uniforms` (`sample_tokens`), or
    the most likely token where `uniforms` is None (greedy)."""
    scores = processors(sequence, logits)  # (R, V)
    token = scores.argmax(dim=-1) if uniforms is None else sample_tokens(scores, uniforms=uniforms)  # (R,)
    logp = torch.log_softmax(scores.float(), dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)  # (R,)
    return token, logp


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
    return Rollout.from_tokens(
        prompt_ids, prompt_mask, completion_ids, sampler_logps, eos_ids, config.pad_token_id
    )


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
    Sampling takes one uniform number per row and step, all drawn up front: the same numbers
    whichever rows finish early, so any decoder samples the same tokens for the same seed.
    """
    processors = logits_processors(config, prompt_ids.shape[1], prompt_ids.device)
    decoder = decoder_for(model, config.max_new_tokens, backend)
    rows, device = prompt_ids.shape[0], prompt_ids.device
    uniforms = (
        torch.rand(config.max_new_tokens, rows, 1, dtype=torch.float64, device=device)
        if config.do_sample
        else None
    )  # (N, B, 1)
    if isinstance(decoder, FIXED_SHAPE_DECODERS):  # keeps its rows and samples inside its step
        decoded = _decode_fixed(
            decoder, prompt_ids, prompt_mask, config, processors, uniforms, all_done, backend
        )
        if decoded is not None:
            return decoded
        # 'auto' after a failed capture: the shrinking loop's decoder from now on
        decoder = decoder_for(model, config.max_new_tokens, backend)
    logits = decoder.prefill(prompt_ids, prompt_mask)  # (B, V)
    eos = torch.tensor(
        config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id],
        device=device,
    )
    new_tokens = torch.full(
        (rows, config.max_new_tokens), config.pad_token_id, dtype=torch.long, device=device
    )
    new_logps = torch.zeros((rows, config.max_new_tokens), device=device)
    going = torch.arange(rows, device=device)  # the decoder's rows, as rows of the batch
    sequence = prompt_ids  # (R, P + t) of the rows still going
    done = False
    for step in range(config.max_new_tokens):
        if not done:
            drawn = None if uniforms is None else uniforms[step, going]  # (R, 1)
            token, new_logps[going, step] = next_tokens(processors, sequence, logits, drawn)  # (R,) each
            new_tokens[going, step] = token
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


def _decode_fixed(
    decoder,  # one of FIXED_SHAPE_DECODERS
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
    processors: LogitsProcessorList,
    uniforms: torch.Tensor | None,
    all_done: Callable[[bool], bool] | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A fixed-shape decoder's (B, C) tokens and log-probs; None where capturing its step failed
    under 'auto', which then decodes the model with rows leaving as they end (`fixed_shape.give_up`).
    An explicit backend's failed capture is an error naming the setting that avoids it."""
    try:
        return fixed_shape.decode(
            decoder, prompt_ids, prompt_mask, config, processors, next_tokens, uniforms, all_done
        )
    except fixed_shape.CaptureFailed as error:
        if backend != "auto":
            raise
        fixed_shape.give_up(decoder.model, error)
        return None


class LocalGenerator(Generator):
    """Generation in the training process, on the policy or its `GenerationCopy`.

    `method`: 'decoder' (our decoding loop; `decoder` is generation_backend's choice of decoder),
    'generate' (transformers' generate) or 'continuous_batching' (transformers' generate_batch).
    `gather` (`ds3_gather_for_generation`): under ZeRO-3, gather the whole model for generation;
    False decodes with it partitioned, every process in lockstep (`sharding.unsharded_for_generation`).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        policy: Callable[[], nn.Module],
        copy: GenerationCopy | None,
        method: str = "decoder",
        decoder: str = "auto",
        batching_kwargs: dict | None = None,
        sharded: bool = False,
        gather: bool = True,
    ):
        super().__init__(accelerator)
        self.policy, self.copy, self.method, self.decoder = policy, copy, method, decoder
        self.batching_kwargs, self.sharded, self.gather = batching_kwargs or {}, sharded, gather

    @property
    def collective(self) -> bool:
        return self.sharded  # whole parameters are gathered around each call

    def load_policy(self, version: int) -> None:
        if self.copy is not None:
            self.copy.refresh()

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Rollout:
        model = self.copy.model if self.copy is not None else self.policy()
        config = generation_config(sampling)
        with unsharded_for_generation(model, self.accelerator, self.gather) as all_done:
            if prompt_ids.shape[0] == 0:
                if all_done is not None:  # in lockstep every process decodes until all are done
                    spare = torch.full((1, 1), sampling.pad_token_id, device=prompt_ids.device)
                    generate(model, spare, torch.ones_like(spare), config, self.decoder, all_done)
                return Rollout.empty(prompt_ids, prompt_mask)
            if self.method == "generate":
                return transformers_generate.with_generate(model, prompt_ids, prompt_mask, config)
            if self.method == "continuous_batching":
                return transformers_generate.with_continuous_batching(
                    model, prompt_ids, prompt_mask, config, self.batching_kwargs
                )
            return generate(model, prompt_ids, prompt_mask, config, self.decoder, all_done)
