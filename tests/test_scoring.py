"""Scoring a batch: what counts as a reward, what a raising function does, how a reward model reads
its input. Pure functions, no trainer."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import CHAT_TEMPLATE, tiny_tokenizer
from tokenizers import processors
from torch import nn

from grpo_hf.scoring import (
    RewardModel,
    RewardOutputError,
    check_reward_values,
    score_completions,
    score_with_model,
)


def test_every_real_number_type_is_a_reward():
    values = [
        np.float32(0.5),
        np.int64(2),
        np.bool_(True),
        True,
        np.float16(-1.5),
        torch.tensor(1.5),
        np.array(3.0),
    ]
    assert check_reward_values("f", values, len(values)) == [0.5, 2.0, 1.0, 1.0, -1.5, 1.5, 3.0]


@pytest.mark.parametrize(
    "value",
    ["1", np.float32("nan"), np.float64("inf"), 1 + 2j, np.complex64(1), torch.tensor([1.0, 2.0]), [1.0]],
    ids=["str", "np-nan", "np-inf", "complex", "np-complex", "two-element-tensor", "list"],
)
def test_non_numbers_nan_and_inf_are_rejected_with_the_function_name(value):
    with pytest.raises(RewardOutputError, match="'my_reward' returned"):
        check_reward_values("my_reward", [value], 1)


def score(func, policy, completions=("a", "bb", "ccc", "dddd")):
    completions = list(completions)
    return score_completions(
        [func],
        ["p"] * len(completions),
        completions,
        [[1]] * len(completions),
        {},
        policy,
        torch.device("cpu"),
    )


def batch_only_failure(completions, **kwargs):
    """Scores one completion at a time, raises on a batch of several (e.g. a batched call that breaks)."""
    if len(completions) > 1:
        raise MemoryError("batch too large")
    return [float(len(completions[0]))]


def test_an_error_on_the_batch_only_stops_the_run_by_default():
    with pytest.raises(
        RuntimeError, match="'batch_only_failure' raised MemoryError: batch too large on a batch of 4"
    ) as error:
        score(batch_only_failure, "raise")
    assert isinstance(error.value.__cause__, MemoryError)  # the original traceback is chained


@pytest.mark.parametrize("policy", ["retry", "zero"])
def test_retry_uses_the_one_at_a_time_scores_and_counts_the_batch(policy):
    rewards, errors, retried = score(batch_only_failure, policy)
    assert rewards[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert (errors, retried) == (0, 1)


def fails_on_bb(completions, **kwargs):
    if "bb" in completions:
        raise KeyError("bb")
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("policy", ["raise", "retry"])
def test_a_completion_that_fails_alone_is_named(policy):
    with pytest.raises(RuntimeError, match="'fails_on_bb' raised KeyError: 'bb' on completion 'bb'") as error:
        score(fails_on_bb, policy)
    assert isinstance(error.value.__cause__, KeyError)


def test_zero_policy_scores_the_failing_completion_0_and_the_others_as_usual():
    rewards, errors, retried = score(fails_on_bb, "zero")
    assert rewards[:, 0].tolist() == [1.0, 0.0, 3.0, 4.0]
    assert (errors, retried) == (1, 1)


class RecordingModel(nn.Module):
    """Stands in for a reward model: remembers its input ids, scores every row 0."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.input_ids = None

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.input_ids = input_ids
        return SimpleNamespace(logits=torch.zeros(len(input_ids), 1))


def bos_tokenizer():
    """tiny_tokenizer with a BOS "<s>" that encoding adds, and a chat template that writes it too
    (as Llama's templates do)."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    assert tokenizer("x")["input_ids"][0] == bos  # encoding adds BOS
    return tokenizer


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_reward_model_input_has_exactly_one_bos(chat):
    tokenizer = bos_tokenizer()
    model = RecordingModel()
    if chat:
        prompts = [[{"role": "user", "content": "What is 1 + 1?"}]] * 2
        completions = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "two"}]]
    else:
        prompts, completions = ["What is 1 + 1? "] * 2, ["2", "two"]
    score_with_model(RewardModel(model, tokenizer, "rm"), prompts, completions)
    bos_per_row = (model.input_ids == tokenizer.bos_token_id).sum(dim=1).tolist()
    assert bos_per_row == [1, 1]
