"""The shrinking loop's logits processors inside a fixed-shape step (`fixed_shape`).

The loop (`local._decode`) hands its processors the sequence drawn so far: the (B, P) left-padded
prompts and the t tokens drawn. A fixed-shape step hands them the bucket's whole (R, W + N)
sequence at every step (`fixed_shape.processor_sequence`): the call's prompts in columns
[W - P, W), token t at column W + t, the other columns repeating the row's last prompt token.
Processors that read only the scores, or only which tokens the sequence holds (the repetition
penalty), give the loop's scores on it unchanged (`AS_THEY_ARE`). Five read its length or its
last tokens, or do what a CUDA capture refuses (a host-to-device copy, a check of a distribution
on the host); each has a twin here that gives the loop's scores from the step counter and the
prompt's first column, both held on the device, so a captured step replays them for any round:
- `min_new_tokens`, `suppress_tokens`: `BanTokens`, a vocabulary mask made once on the device;
- `eta_cutoff`: `EtaCutoff`, the same maths without the distribution's host-side check;
- `no_repeat_ngram_size`: `NoRepeatNGram`, windows of the drawn columns only;
- `bad_words_ids`: `BadWords`, each banned sequence's prefix matched against the last tokens drawn.
"""

import math

import torch
from torch.distributions import Categorical
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

AS_THEY_ARE = (
    TemperatureLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
)


class Where:
    """Where a fixed-shape call is, on the device: `t` (1,) the tokens drawn, `start` (1,) the
    bucket's first column of the call's prompt (W - P); `width`, W, the bucket's prompt columns.
    The loop's sequence is columns [start, W + t); its length P + t."""

    def __init__(self, t: torch.Tensor, start: torch.Tensor, width: int):
        self.t, self.start, self.width = t, start, width

    def length(self) -> torch.Tensor:
        """(1,) the length of the loop's sequence, P + t."""
        return self.t + (self.width - self.start)

    def last(self, sequence: torch.Tensor, n: int) -> torch.Tensor:
        """(R, n) the last n tokens drawn, or prompt tokens before them (bucket filler where P + t < n)."""
        columns = self.width + self.t - n + torch.arange(n, device=sequence.device)  # (n,)
        return sequence.index_select(1, columns.clamp(min=0))


def vocabulary_mask(ids: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """(V,) True at the token ids `ids` that are in the vocabulary."""
    return torch.isin(torch.arange(vocab), ids.reshape(-1).cpu()).to(device)


class BanTokens:
    """The scores of `mask`'s tokens set to -inf: always (`suppress_tokens`), or while fewer than
    `until` tokens are drawn (`min_new_tokens`, the EOS tokens)."""

    def __init__(self, mask: torch.Tensor, where: Where | None = None, until: int = 0):
        self.mask, self.where, self.until = mask, where, until

    @classmethod
    def suppressed(cls, processor: SuppressTokensLogitsProcessor, where: Where, vocab: int, device):
        return cls(vocabulary_mask(processor.suppress_tokens, vocab, device))

    @classmethod
    def min_new_tokens(cls, processor: MinNewTokensLengthLogitsProcessor, where: Where, vocab: int, device):
        return cls(vocabulary_mask(processor.eos_token_id, vocab, device), where, processor.min_new_tokens)

    def __call__(self, sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = self.mask if self.where is None else self.mask & (self.where.t < self.until)  # (V,)
        return scores.masked_fill(mask, -math.inf)


class EtaCutoff:
    """`EtaLogitsWarper`'s cut: tokens less likely than min(eps, sqrt(eps) exp(-entropy)) go, the
    `min_tokens_to_keep` most likely stay. Its distribution checks its logits on the host; this
    one is built unchecked."""

    def __init__(self, processor: EtaLogitsWarper, where: Where, vocab: int, device):
        self.epsilon = processor.epsilon.to(device)  # 0-dim
        self.keep, self.filter_value = processor.min_tokens_to_keep, processor.filter_value

    def __call__(self, sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probabilities = scores.softmax(dim=-1)  # (R, V)
        entropy = Categorical(logits=scores, validate_args=False).entropy()  # (R,)
        eta = torch.min(self.epsilon, torch.sqrt(self.epsilon) * torch.exp(-entropy)).unsqueeze(-1)  # (R, 1)
        kept = torch.topk(scores, min(self.keep, scores.shape[-1]))[0][..., -1:]  # (R, 1)
        return scores.masked_fill((probabilities < eta) & (scores < kept), self.filter_value)


class NoRepeatNGram:
    """`no_repeat_ngram_size` n: a token that would complete an n-gram the loop's sequence already
    holds gets -inf. Each window of n columns that lies inside it and starts with its last n - 1
    tokens bans its own last token."""

    def __init__(self, processor: NoRepeatNGramLogitsProcessor, where: Where, vocab: int, device):
        self.n, self.where = processor.ngram_size, where

    def __call__(self, sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, where, vocab = self.n, self.where, scores.shape[-1]
        if n > sequence.shape[1]:  # no n-gram fits in the bucket, nor in the loop's shorter sequence
            return scores
        windows = sequence.unfold(1, n, 1)  # (R, K, n), K windows by first column
        first = torch.arange(windows.shape[1], device=sequence.device)  # (K,)
        inside = (first >= where.start) & (first + n <= where.width + where.t)  # (K,)
        prefix = where.last(sequence, n - 1)  # (R, n - 1)
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & inside  # (R, K): none if P + t < n
        banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)  # a spare column
        banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
        return scores.masked_fill(banned[:, :vocab], -math.inf)


class BadWords:
    """`bad_words_ids` (the loop's `NoBadWordsLogitsProcessor`, EOS-only words dropped): a
    one-token word always gets -inf, a longer one's last token when the tokens before it are the
    last ones drawn (prompt tokens included, as in the loop)."""

    def __init__(self, processor: NoBadWordsLogitsProcessor, where: Where, vocab: int, device):
        words = list(processor.sequence_bias)  # token-id tuples, each biased -inf
        outside = sorted({token for word in words for token in word if token >= vocab})
        if outside:
            raise ValueError(
                f"bad_words_ids holds token ids {outside} outside the model's vocabulary of {vocab}."
            )
        self.where, self.single = where, torch.zeros(vocab, device=device)  # (V,)
        self.single[[word[0] for word in words if len(word) == 1]] = -math.inf
        by_prefix_length: dict[int, list[tuple[int, ...]]] = {}
        for word in words:
            if len(word) > 1:
                by_prefix_length.setdefault(len(word) - 1, []).append(word)
        self.groups = [
            (
                torch.tensor([word[:-1] for word in group], device=device),  # (G, L) prefixes
                torch.tensor([word[-1] for word in group], device=device),  # (G,) last tokens
            )
            for group in by_prefix_length.values()
        ]

    def __call__(self, sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(scores) + self.single  # (R, V)
        for prefixes, last in self.groups:
            length = prefixes.shape[1]
            tail = self.where.last(sequence, length)  # (R, L)
            matching = (tail.unsqueeze(1) == prefixes).all(dim=-1) & (self.where.length() >= length)  # (R, G)
            bias.index_add_(1, last, torch.where(matching, -math.inf, 0.0).to(bias.dtype))
        return scores + bias


TWINS = {
    SuppressTokensLogitsProcessor: BanTokens.suppressed,
    MinNewTokensLengthLogitsProcessor: BanTokens.min_new_tokens,
    EtaLogitsWarper: EtaCutoff,
    NoRepeatNGramLogitsProcessor: NoRepeatNGram,
    NoBadWordsLogitsProcessor: BadWords,
}


def for_fixed_shapes(
    processors: LogitsProcessorList, where: Where, vocab: int, device
) -> LogitsProcessorList:
    """The loop's `processors` (`local.logits_processors`) for a fixed-shape step, in their order."""
    fixed = LogitsProcessorList()
    for processor in processors:
        if isinstance(processor, AS_THEY_ARE):
            fixed.append(processor)
        elif type(processor) in TWINS:
            fixed.append(TWINS[type(processor)](processor, where, vocab, device))
        else:
            raise TypeError(f"No fixed-shape form of {type(processor).__name__}.")
    return fixed
