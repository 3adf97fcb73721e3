"""The decode loop: same tokens as `model.generate`, masks after the first EOS, shared prefill."""

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_llama, tiny_tokenizer
from transformers import GenerationConfig

from grpo_hf import rollout


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
    ours = rollout.generate(model, ids, mask, config)
    reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[
        :, ids.shape[1] :
    ]
    reference_mask, _ = rollout.completion_mask_after_eos(reference, [2])
    width = ours.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids, reference.masked_fill(reference_mask == 0, 0)[:, :width])


def test_sample_tokens_follows_the_softmax():
    torch.manual_seed(0)
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(20000, 4)  # (N, 4)
    counts = torch.bincount(rollout.sample_tokens(scores), minlength=4).float() / 20000
    # binomial std at p=0.5, N=20000 is 0.0035: 0.015 is over 4 std
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.2, 0.0]), rtol=0, atol=0.015)


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
        rollout.generate(model, ids, mask, top1).completion_ids,
        rollout.generate(model, ids, mask, greedy).completion_ids,
    )


def test_completion_mask_ends_after_first_eos_and_flags_truncation():
    completions = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])  # eos = 2
    mask, truncated = rollout.completion_mask_after_eos(completions, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_unique_rows_finds_each_prompts_copies():
    tokenizer = tiny_tokenizer()
    ids, mask = prompts(tokenizer, repeats=2)
    first, row_to_unique = rollout.unique_rows(ids, mask)
    assert first.tolist() == [0, 2, 4]
    assert row_to_unique.tolist() == [0, 0, 1, 1, 2, 2]


def test_long_prompts_keep_their_last_tokens(caplog):
    tokenizer = tiny_tokenizer()
    ids, mask = rollout.tokenize_prompts(tokenizer, ["abcdefgh", "xy"], 4, torch.device("cpu"))
    assert tokenizer.decode(ids[0]) == "efgh"
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert "max_prompt_length=4" in caplog.text
