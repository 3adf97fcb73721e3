"""`async def` reward functions: awaited together, checked and error-handled like plain ones."""

import asyncio
import math
import time

import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config

from grpo_hf.rewards.async_rewards import is_async_reward
from grpo_hf.rewards.scoring import score_completions

PROMPTS = ["a", "b", "c"]
COMPLETIONS = ["x", "yy", "zzz"]
IDS = [[1], [2, 2], [3, 3, 3]]
COLUMNS = {"answer": ["1", "2", "3"]}
CPU = torch.device("cpu")


def score(funcs, policy="raise"):
    return score_completions(funcs, PROMPTS, COMPLETIONS, IDS, COLUMNS, policy, CPU)


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


async def slow_length(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [float(len(c)) for c in completions]


async def slow_answer(completions, answer, **kwargs):
    await asyncio.sleep(0.2)
    return [float(a) for a in answer]


def test_async_rewards_run_concurrently_and_score_like_sync_ones():
    start = time.perf_counter()
    rewards, errors, _ = score([slow_length, length, slow_answer])
    elapsed = time.perf_counter() - start
    assert elapsed < 0.35  # two 0.2 s sleeps overlap; one after the other would take 0.4 s
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 3.0, 3.0]])  # (N, F)
    torch.testing.assert_close(rewards, expected)
    assert errors == 0
    sync_rewards, *_ = score([length, length, lambda completions, answer, **kw: [float(a) for a in answer]])
    torch.testing.assert_close(rewards, sync_rewards)


def test_is_async_reward_sees_functions_and_callable_objects():
    class Judge:
        async def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

    assert is_async_reward(slow_length) and is_async_reward(Judge())
    assert not is_async_reward(length)
    assert score([Judge()])[0].tolist() == [[1.0], [1.0], [1.0]]


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        (lambda n: [1.0] * (n - 1), r"'bad' returned 2 values for 3 completions"),
        (lambda n: ["1"] * n, r"'bad' returned '1' \(str\)"),
        (lambda n: [math.nan] * n, r"'bad' returned nan"),
        (lambda n: [math.inf] * n, r"'bad' returned inf"),
    ],
    ids=["length", "type", "nan", "inf"],
)
def test_bad_async_reward_values_name_the_function(returns, message):
    async def bad(completions, **kwargs):
        return returns(len(completions))

    with pytest.raises(ValueError, match=message):
        score([length, bad])


async def picky(completions, **kwargs):
    """Raises on the completion "yy" only."""
    await asyncio.sleep(0)
    if "yy" in completions:
        raise KeyError("cannot score this one")
    return [float(len(c)) for c in completions]


def test_a_raising_async_reward_names_the_function_and_the_completion():
    with pytest.raises(RuntimeError, match=r"'picky' raised KeyError.*on completion 'yy'"):
        score([length, picky])


def test_a_raising_async_reward_scores_0_under_the_zero_policy():
    rewards, errors, _ = score([picky, slow_length], policy="zero")
    assert rewards[:, 0].tolist() == [1.0, 0.0, 3.0]  # "yy" scored 0, the others scored alone
    assert rewards[:, 1].tolist() == [1.0, 2.0, 3.0]
    assert errors == 1


def test_the_trainer_logs_an_async_reward_by_name(tmp_path):
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=[slow_length, length_reward],
        args=make_config(tmp_path, max_steps=1),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["reward/slow_length"] > 0 and "reward/length_reward" in logged


async def batch_shy(completions, **kwargs):
    """Raises on any batch of several completions, scores each one alone."""
    if len(completions) > 1:
        raise TimeoutError("the judge dropped a batch")
    return [float(len(completions[0]))]


def test_an_async_error_on_the_batch_only_follows_the_policy():
    with pytest.raises(RuntimeError, match="'batch_shy' raised TimeoutError.*scored each of them alone"):
        score([batch_shy])
    rewards, errors, retried = score([batch_shy], policy="retry")
    assert rewards[:, 0].tolist() == [1.0, 2.0, 3.0] and (errors, retried) == (0, 1)
