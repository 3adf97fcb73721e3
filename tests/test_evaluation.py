"""Greedy held-out accuracy and the training plot, on a tiny model."""

import pytest
from datasets import Dataset
from tiny_models import tiny_llama, tiny_tokenizer

from grpo_hf.evaluation import greedy_accuracy
from grpo_hf.plotting import PANELS, plot_training


def column_reward(completions, score, **kwargs):
    """The dataset's own `score` column: the accuracy is known before decoding anything."""
    assert len(completions) == len(score)
    return list(score)


def test_greedy_accuracy_averages_the_reward_over_every_batch_and_none_counts_0():
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(5)]
    dataset = Dataset.from_dict({"prompt": prompts, "score": [1.0, 0.0, None, 1.0, 0.5]})

    result = greedy_accuracy(
        tiny_llama(), tiny_tokenizer(), dataset, column_reward, batch_size=2, max_new_tokens=3, num_samples=3
    )

    assert result.accuracy == pytest.approx((1.0 + 0.0 + 0.0 + 1.0 + 0.5) / 5)
    assert [(q, s) for q, _, s in result.samples] == [
        ("question 0", 1.0),
        ("question 1", 0.0),
        ("question 2", 0.0),
    ]
    assert all(isinstance(completion, str) for _, completion, _ in result.samples)


def test_greedy_accuracy_takes_an_async_reward():
    async def async_column_reward(completions, score, **kwargs):
        return list(score)

    dataset = Dataset.from_dict({"prompt": ["abc", "hello"], "score": [1.0, 0.5]})
    result = greedy_accuracy(tiny_llama(), tiny_tokenizer(), dataset, async_column_reward, max_new_tokens=2)
    assert result.accuracy == pytest.approx(0.75)


def test_greedy_decoding_is_deterministic():
    dataset = Dataset.from_dict({"prompt": ["abc", "hello"], "score": [1.0, 1.0]})
    first = greedy_accuracy(tiny_llama(), tiny_tokenizer(), dataset, column_reward, max_new_tokens=5)
    second = greedy_accuracy(tiny_llama(), tiny_tokenizer(), dataset, column_reward, max_new_tokens=5)
    assert first.samples == second.samples
    assert [q for q, _, _ in first.samples] == ["abc", "hello"]  # plain-text prompts shown as they are


def test_plot_has_a_panel_per_metric_and_tolerates_missing_ones(tmp_path):
    history = [{"step": s, "reward": s / 10, "completions/mean_length": 20 - s} for s in range(1, 6)]
    history.append({"step": 5, "train_runtime": 1.0})  # the Trainer's summary row: no metrics
    path = plot_training(history, str(tmp_path / "training.png"))  # no "kl": beta = 0
    assert len(PANELS) == 3
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path == str(tmp_path / "training.png")


def test_greedy_completions_are_the_argmax_tokens():
    """Each completion is the argmax token at every step, computed here one unpadded prompt at a
    time with the model's own forward (greedy_accuracy pads a batch of two)."""
    import torch

    model, tokenizer = tiny_llama().eval(), tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["abc", "a longer prompt"], "score": [1.0, 1.0]})
    result = greedy_accuracy(model, tokenizer, dataset, column_reward, batch_size=2, max_new_tokens=6)
    for prompt, completion, _ in result.samples:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]  # (1, P)
        new = []
        for _ in range(6):
            with torch.no_grad():
                token = model(input_ids=ids).logits[0, -1].argmax().item()
            new.append(token)
            if token == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        assert completion == tokenizer.decode(new, skip_special_tokens=True)
