"""The decode loop: same tokens as `model.generate`, masks after the first EOS, shared prefill."""

import pytest
import torch
from tiny_models import ScriptedDecoder, tiny_gpt2, tiny_llama, tiny_tokenizer
from transformers import GenerationConfig

from grpo_hf.data import rollout
from grpo_hf.engine import local
from grpo_hf.engine.generation import Sampling
from grpo_hf.engine.logprobs import unique_rows


def prompts(tokenizer, repeats: int = 3):
    texts = ["What is 1 + 1?", "Hi", "A much longer prompt, to force left padding."]
    rows = [
        rollout.render_prompt(tokenizer, [{"role": "user", "content": t}])
        for t in texts
        for _ in range(repeats)
    ]
    return rollout.tokenize_prompts(tokenizer, rows, None, torch.device("cpu"))


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_greedy_decode_matches_model_generate(build):
    tokenizer, model = tiny_tokenizer(), build().eval()
    ids, mask = prompts(tokenizer)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=[2])
    ours = local.generate(model, ids, mask, config)
    reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[
        :, ids.shape[1] :
    ]
    reference_mask, _ = rollout.completion_mask_after_eos(reference, [2])
    width = ours.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids, reference.masked_fill(reference_mask == 0, 0)[:, :width])


def test_rows_that_drew_eos_leave_the_decoder(monkeypatch):
    decoder = ScriptedDecoder([5, 2, 4, 2, 6])
    monkeypatch.setattr(local, "decoder_for", lambda *args: decoder)
    ids = torch.ones(5, 3, dtype=torch.long)
    config = GenerationConfig(do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=[2])
    result = local.generate(torch.nn.Linear(1, 1), ids, torch.ones_like(ids), config)
    assert decoder.rows_per_call == [5, 5, 3, 3, 2, 1]  # prefill, then steps 1..5
    assert result.completion_ids.tolist() == [
        [3, 3, 3, 3, 2, 0],
        [3, 2, 0, 0, 0, 0],
        [3, 3, 3, 2, 0, 0],
        [3, 2, 0, 0, 0, 0],
        [3, 3, 3, 3, 3, 2],
    ]
    assert result.completion_mask.sum(1).tolist() == [5, 2, 4, 2, 6]
    assert (result.sampler_logps == 0).all()  # each drawn token had probability 1 (to float32)
    assert not result.truncated.any()


class FixedLogits:
    """A decoder whose next-token distribution is always softmax(`logits`)."""

    def __init__(self, logits: torch.Tensor):
        self.logits, self.rows = logits, 0

    def prefill(self, prompt_ids, prompt_mask):
        self.rows = prompt_ids.shape[0]
        return self.logits.expand(self.rows, -1)  # (B, V)

    def __call__(self, token):
        return self.logits.expand(len(token), -1)

    def keep(self, rows):
        pass


@pytest.mark.parametrize(
    "knobs",
    [{"top_k": 2}, {"top_p": 0.6}, {"min_p": 0.6}],
    ids=["top_k", "top_p", "min_p"],
)
def test_sampler_logps_are_those_of_the_truncated_distribution(monkeypatch, knobs):
    """4 tokens with p = (0.4, 0.3, 0.2, 0.1). top_k=2 keeps the two likeliest; top_p=0.6 too (0.4 < 0.6
    <= 0.4 + 0.3); min_p=0.6 keeps p >= 0.6 x 0.4 = 0.24: the same two. The sampler draws from
    (0.4, 0.3) / 0.7, so a drawn token's recorded log-prob is log(p / 0.7), not log p: the
    distribution actually sampled, as vLLM's processed_logprobs."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    monkeypatch.setattr(local, "decoder_for", lambda *args: FixedLogits(p.log()))
    settings = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}
    config = local.generation_config(
        Sampling(max_new_tokens=1, pad_token_id=0, eos_token_ids=[3], **(settings | knobs))
    )
    ids = torch.ones(200, 2, dtype=torch.long)  # (B, P)
    torch.manual_seed(0)
    result = local.generate(torch.nn.Linear(1, 1), ids, torch.ones_like(ids), config)
    drawn = result.completion_ids[:, 0]  # (B,)
    assert set(drawn.tolist()) == {0, 1}  # both kept tokens drawn, never a cut one
    torch.testing.assert_close(result.sampler_logps[:, 0], torch.log(p[drawn] / 0.7))


class EitherEndsDecoder:
    """Row 0 draws uniformly from tokens 3..7, never EOS (2); row 1 draws EOS at once if `ends`,
    else as row 0. It learns which rows it serves only through `keep`, as ScriptedDecoder."""

    def __init__(self, ends: bool):
        self.ends, self.serving = ends, None

    def logits(self) -> torch.Tensor:
        logits = torch.zeros(len(self.serving), 8)
        logits[:, :3] = -float("inf")  # (R, 8): uniform over 3..7
        if self.ends:
            logits[self.serving == 1] = 100.0 * torch.nn.functional.one_hot(torch.tensor(2), 8)
        return logits

    def prefill(self, prompt_ids, prompt_mask):
        self.serving = torch.arange(prompt_ids.shape[0])
        return self.logits()

    def __call__(self, token):
        return self.logits()

    def keep(self, rows):
        self.serving = self.serving[rows]


def test_a_rows_draws_do_not_depend_on_when_the_other_rows_end(monkeypatch):
    """One uniform per row and step, drawn up front: row 0 samples the same 12 tokens for the same
    seed whether row 1 leaves the decoder at once or runs on (drawing only for the rows still
    going would shift row 0's numbers once row 1 left: 5 choices a step, 11 steps)."""
    ids = torch.ones(2, 3, dtype=torch.long)
    config = GenerationConfig(do_sample=True, max_new_tokens=12, pad_token_id=0, eos_token_id=[2])
    runs = []
    for ends in (True, False):
        monkeypatch.setattr(local, "decoder_for", lambda *args, ends=ends: EitherEndsDecoder(ends))
        torch.manual_seed(0)
        runs.append(local.generate(torch.nn.Linear(1, 1), ids, torch.ones_like(ids), config))
    ended, ran_on = runs
    assert ended.completion_ids[1].tolist() == [2] + [0] * 11 and ran_on.completion_mask[1].sum() == 12
    assert torch.equal(ended.completion_ids[0], ran_on.completion_ids[0])
    assert not torch.equal(ran_on.completion_ids[0], ran_on.completion_ids[1])  # rows draw their own numbers


@pytest.mark.parametrize("block", [2, 3, 256], ids=["block-2", "block-3", "one-block"])
def test_sample_tokens_follows_the_softmax(block):
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.15, 0.05, 0.0])  # 7 tokens: several blocks, a ragged end
    scores = torch.log(probs).expand(40000, 7)  # (N, 7); log 0 = -inf
    counts = torch.bincount(local.sample_tokens(scores, block=block), minlength=7).float() / 40000
    # binomial std at p=0.5, N=40000 is 0.0025: 0.01 is 4 std
    torch.testing.assert_close(counts, probs, rtol=0, atol=0.01)
    assert counts[[1, 3, 6]].sum() == 0  # probability 0: never drawn


def test_sample_tokens_rows_are_independent_distributions():
    torch.manual_seed(1)
    scores = torch.tensor([[0.0, -float("inf"), -float("inf")], [-float("inf"), -float("inf"), 5.0]])
    draws = local.sample_tokens(scores.repeat(500, 1), block=2).view(500, 2)  # (500, 2)
    assert (draws[:, 0] == 0).all() and (draws[:, 1] == 2).all()


def test_sample_tokens_tail_next_to_a_dominant_token():
    """255 tokens sharing 1% beside one of 99%: the tail keeps its share."""
    torch.manual_seed(2)
    probs = torch.full((256,), 0.01 / 255)
    probs[0] = 0.99  # (256,)
    draws = local.sample_tokens(torch.log(probs).expand(40000, 256), block=16)
    tail = (draws != 0).float().mean().item()
    assert abs(tail - 0.01) < 5 * (0.01 * 0.99 / 40000) ** 0.5  # 5 std of the binomial
    assert len(draws[draws != 0].unique()) > 200  # spread over the tail, not stuck on a few tokens


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_sampling_knobs_restrict_the_support(build):
    """top_k=1 sampling must equal greedy decoding, whatever the temperature."""
    tokenizer, model = tiny_tokenizer(), build().eval()
    ids, mask = prompts(tokenizer)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=[2])
    top1 = GenerationConfig(
        do_sample=True, temperature=1.7, top_k=1, max_new_tokens=8, pad_token_id=0, eos_token_id=[2]
    )
    torch.manual_seed(3)
    assert torch.equal(
        local.generate(model, ids, mask, top1).completion_ids,
        local.generate(model, ids, mask, greedy).completion_ids,
    )


def test_completion_mask_ends_after_first_eos_and_flags_truncation():
    completions = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])  # eos = 2
    mask, truncated = rollout.completion_mask_after_eos(completions, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_unique_rows_finds_each_prompts_copies():
    tokenizer = tiny_tokenizer()
    ids, mask = prompts(tokenizer, repeats=2)
    first, row_to_unique = unique_rows(ids, mask)
    assert first.tolist() == [0, 2, 4]
    assert row_to_unique.tolist() == [0, 0, 1, 1, 2, 2]


def test_long_prompts_keep_their_last_tokens(caplog):
    tokenizer = tiny_tokenizer()
    ids, mask = rollout.tokenize_prompts(tokenizer, ["abcdefgh", "xy"], 4, torch.device("cpu"))
    assert tokenizer.decode(ids[0]) == "efgh"
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert "max_prompt_length=4" in caplog.text


@pytest.mark.parametrize(
    "knobs",
    [
        {"top_p": 0.8},
        {"min_p": 0.2},
        {"repetition_penalty": 1.5},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3},
        # generation_kwargs: GenerationConfig keys our decoding loop implements too
        {"generation_kwargs": {"no_repeat_ngram_size": 2, "suppress_tokens": [5, 6], "min_new_tokens": 3}},
        {"generation_kwargs": {"bad_words_ids": [[7], [8, 9]], "typical_p": 0.9}},
        {"generation_kwargs": {"epsilon_cutoff": 3e-3}},
        {"generation_kwargs": {"eta_cutoff": 3e-3, "top_p": 0.7}},  # overrides top_p
    ],
    ids=[
        "top_p",
        "min_p",
        "repetition_penalty",
        "all",
        "ngram_suppress_min_new",
        "bad_words_typical",
        "epsilon",
        "eta",
    ],
)
def test_sampling_knobs_transform_logits_as_model_generate_does(knobs):
    """Our processors on the raw logits of each prefix equal the scores `model.generate` reports
    (transformers' own processors) for the same settings, at every step of a sampled completion."""
    settings = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": None,
        "repetition_penalty": 1.0,
        **knobs,
    }
    extra = settings.pop("generation_kwargs", {})
    config = local.generation_config(
        Sampling(max_new_tokens=6, pad_token_id=0, eos_token_ids=[2], generation_kwargs=extra, **settings)
    )
    model = tiny_llama().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaky distributions, so top_p / min_p cut somewhere
    torch.manual_seed(4)
    ids = torch.randint(3, 250, (4, 6))  # (B, P) no padding
    ids[:, 3:] = ids[:, :3]  # repeated tokens for the penalty
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    processors = local.logits_processors(config, prompt_width=ids.shape[1])
    cut = 0
    for t, expected in enumerate(out.scores):  # (B, V) each
        prefix = out.sequences[:, : ids.shape[1] + t]
        with torch.no_grad():
            raw = model(input_ids=prefix).logits[:, -1].float()  # (B, V)
        ours = processors(prefix, raw.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(expected)), f"step {t}: different support"
        finite = torch.isfinite(expected)
        torch.testing.assert_close(ours[finite], expected[finite].float(), rtol=1e-4, atol=1e-4)
        cut += int(torch.isinf(expected).any())
    if {"top_p", "min_p", "generation_kwargs"} & knobs.keys():
        assert cut > 0  # the knob removed tokens: the support check was not vacuous


def test_sampler_logps_are_the_drawn_tokens_log_probs():
    """Temperature only (no truncation): the sampler's log-probs equal the policy's own log-probs
    of the same tokens at that temperature, recomputed with a full forward; 0 after the EOS."""
    from grpo_hf.engine.logprobs import completion_logps

    tokenizer, model = tiny_tokenizer(), tiny_llama().eval()
    ids, mask = prompts(tokenizer, repeats=2)
    config = local.generation_config(
        Sampling(
            max_new_tokens=8, temperature=0.7, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
            pad_token_id=0, eos_token_ids=[2],
        )
    )  # fmt: skip
    torch.manual_seed(5)
    result = local.generate(model, ids, mask, config)
    expected, _, _ = completion_logps(
        model, result.input_ids, result.attention_mask, result.completion_ids.shape[1], temperature=0.7
    )
    active = result.completion_mask.bool()
    torch.testing.assert_close(result.sampler_logps[active], expected[active], rtol=1e-4, atol=1e-4)
    assert (result.sampler_logps[~active] == 0).all()
