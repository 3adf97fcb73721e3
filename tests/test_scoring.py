"""Scoring a batch: what counts as a reward, what a raising function does, how a reward model reads
its input. Pure functions, no trainer."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import CHAT_TEMPLATE, tiny_tokenizer
from tokenizers import processors
from torch import nn

from grpo_hf.rewards.reward_outputs import RewardLogs, RewardOutputError, check_reward_values
from grpo_hf.rewards.scoring import RewardModel, score_completions, score_with_model


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


# ---- TRL's keywords: trainer_state, log_extra, log_metric ----------------------------------------


def score_logged(funcs, policy="raise", completions=("a", "bb", "ccc", "dddd"), state=None):
    """Score with the keyword arguments TRL hands over; return the rewards, counts and what was logged."""
    completions = list(completions)
    logs = RewardLogs(len(completions))
    rewards, errors, retried = score_completions(
        funcs,
        ["p"] * len(completions),
        completions,
        [[1]] * len(completions),
        {"answer": [str(len(c)) for c in completions]},
        policy,
        torch.device("cpu"),
        trainer_state=state,
        logs=logs,
    )
    return rewards, errors, retried, logs


def test_named_columns_without_kwargs_still_work_and_named_keywords_arrive():
    def columns_only(prompts, completions, completion_ids, answer):  # takes no **kwargs
        return [float(a) for a in answer]

    def wants_state(prompts, completions, completion_ids, answer, trainer_state):  # names it, no **kwargs
        return [float(trainer_state.global_step)] * len(completions)

    state = SimpleNamespace(global_step=7)
    rewards, *_ = score_logged([columns_only, wants_state], state=state)
    assert rewards.tolist() == [[1.0, 7.0], [2.0, 7.0], [3.0, 7.0], [4.0, 7.0]]


def logging_reward(completions, log_extra, log_metric, trainer_state, **kwargs):
    log_extra("first_letter", [c[0] for c in completions])
    log_metric("letters", sum(len(c) for c in completions) / len(completions))
    return [float(len(c)) for c in completions]


def test_log_extra_fills_one_column_per_completion_and_log_metric_one_value_per_call():
    rewards, _, _, logs = score_logged([logging_reward])
    assert rewards[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert logs.extra_rows == [{"first_letter": x} for x in "abcd"]
    assert logs.metrics == {"letters": [2.5]}  # (1 + 2 + 3 + 4) / 4, one call


def test_log_extra_keeps_plain_values_as_the_table_shows_them():
    """NumPy and tensor values become the Python values they hold (a checkpoint's torch.load(weights_only=True)
    refuses NumPy scalars); anything else but None, bool, int, float and str becomes its str()."""

    def numpy_logging(completions, log_extra, **kwargs):
        log_extra("length", np.array([float(len(c)) for c in completions]))  # np.float64 values
        log_extra("mixed", [np.int64(7), torch.tensor(0.5), np.bool_(True), [1, 2]])
        return [1.0] * len(completions)

    _, _, _, logs = score_logged([numpy_logging])
    assert [row["length"] for row in logs.extra_rows] == [1.0, 2.0, 3.0, 4.0]
    assert [row["mixed"] for row in logs.extra_rows] == [7, 0.5, True, "[1, 2]"]
    cells = [value for row in logs.extra_rows for value in row.values()]
    assert {type(value) for value in cells} == {float, int, bool, str}


def logs_then_fails_on_batches(completions, log_extra, log_metric, **kwargs):
    """Logs, then raises on a batch of several completions; "bb" also fails alone."""
    log_extra("seen", [f"{c}:{len(completions)}" for c in completions])
    log_metric("calls", 1.0)
    if len(completions) > 1 or completions == ["bb"]:
        raise MemoryError("batch too large")
    return [float(len(completions[0]))]


def test_what_a_failed_call_logged_is_dropped_and_each_single_call_logs_its_own_row():
    rewards, errors, retried, logs = score_logged([logs_then_fails_on_batches], policy="zero")
    assert rewards[:, 0].tolist() == [1.0, 0.0, 3.0, 4.0] and (errors, retried) == (1, 1)
    # Not "a:4" (the failed batch call); "bb" raised alone, so its row has nothing.
    assert logs.extra_rows == [{"seen": "a:1"}, {}, {"seen": "ccc:1"}, {"seen": "dddd:1"}]
    assert logs.metrics == {"calls": [1.0, 1.0, 1.0]}  # the three single calls that scored


async def async_logging_reward(completions, log_extra, log_metric, **kwargs):
    log_extra("doubled", [c * 2 for c in completions])
    log_metric("async_calls", 1)
    return [1.0] * len(completions)


def test_async_and_plain_functions_each_log_their_own_values():
    _, _, _, logs = score_logged([async_logging_reward, logging_reward])
    assert logs.extra_rows[1] == {"doubled": "bbbb", "first_letter": "b"}
    assert logs.metrics == {"async_calls": [1.0], "letters": [2.5]}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda log_extra, log_metric: log_extra("x", [1, 2]), r"log_extra\('x', ...\) with 2 values for 4"),
        (lambda log_extra, log_metric: log_metric("x", "high"), r"log_metric\('x', 'high'\)"),
    ],
    ids=["extra-length", "metric-type"],
)
def test_bad_log_calls_stop_the_run_naming_the_function(call, message):
    def careless(completions, log_extra, log_metric, **kwargs):
        call(log_extra, log_metric)
        return [1.0] * len(completions)

    with pytest.raises(RewardOutputError, match=r"'careless' called " + message):
        score_logged([careless], policy="zero")  # not retried one by one: the call itself is wrong


def test_completions_without_any_reward_are_warned_about_and_stay_nan(caplog):
    def only_long(completions, **kwargs):
        return [float(len(c)) if len(c) > 2 else None for c in completions]

    with caplog.at_level("WARNING", logger="grpo_hf.rewards.scoring"):
        rewards, *_ = score_logged([only_long, lambda completions, **kw: [None] * len(completions)])
    assert rewards[:2].isnan().all() and rewards[2:, 0].tolist() == [3.0, 4.0]
    # TRL's words, naming the first such completion's keyword arguments, then how many and what follows
    assert (
        "All reward functions returned None for the following kwargs:\n"
        "{'answer': '1', 'prompt': 'p', 'completion': 'a'}\n"
        "Please ensure that at least one reward function returns a valid reward.\n"
        "2 of 4 completions got no reward."
    ) in caplog.text
    assert "advantage 0" in caplog.text
