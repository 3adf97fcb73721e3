"""Locally generated tasks: determinism, held-out splits, formats, solvability, argument errors."""

import re

import pytest

from grpo_hf.rewards import accuracy_reward, countdown_reward, evaluate_expression
from grpo_hf.tasks import (
    ARITHMETIC_OPERATIONS,
    ARITHMETIC_SYSTEM_PROMPT,
    TASKS,
    arithmetic_dataset,
    calculator,
    calculator_dataset,
    countdown_dataset,
)

_QUESTION = re.compile(r"(-?\d+) ([-+*]) \(?(-?\d+)\)?")


def questions(split) -> list[tuple[int, str, int]]:
    out = []
    for prompt in split["prompt"]:
        a, op, b = _QUESTION.search(prompt[-1]["content"]).groups()
        out.append((int(a), op, int(b)))
    return out


# --- arithmetic -------------------------------------------------------------------------------------------


def test_arithmetic_sizes_columns_and_chat_format():
    data = arithmetic_dataset(num_train=50, num_test=10)
    assert set(data) == {"train", "test"}
    assert (len(data["train"]), len(data["test"])) == (50, 10)
    assert data["train"].column_names == ["prompt", "answer"]
    prompt = data["train"][0]["prompt"]
    assert prompt[0] == {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    assert prompt[1]["role"] == "user"
    assert len(prompt) == 2


def test_arithmetic_no_system_prompt():
    prompt = arithmetic_dataset(num_train=5, num_test=5, system_prompt=None)["train"][0]["prompt"]
    assert [m["role"] for m in prompt] == ["user"]


def test_arithmetic_default_sizes_fit():
    data = arithmetic_dataset()
    assert (len(data["train"]), len(data["test"])) == (2000, 200)


def test_arithmetic_deterministic_for_a_seed():
    assert (
        arithmetic_dataset(100, 20, seed=3)["train"].to_list()
        == arithmetic_dataset(100, 20, seed=3)["train"].to_list()
    )
    assert (
        arithmetic_dataset(100, 20, seed=3)["test"].to_list()
        == arithmetic_dataset(100, 20, seed=3)["test"].to_list()
    )
    assert (
        arithmetic_dataset(100, 20, seed=3)["train"].to_list()
        != arithmetic_dataset(100, 20, seed=4)["train"].to_list()
    )


def test_arithmetic_answers_are_right_and_wordings_vary():
    data = arithmetic_dataset(200, 20, low=-5, high=30, operations=("+", "-", "*"))
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for (a, op, b), answer in zip(questions(data["train"]), data["train"]["answer"], strict=True):
        assert answer == str(ops[op](a, b))
        assert -5 <= a <= 30 and -5 <= b <= 30
    assert {op for _, op, _ in questions(data["train"])} == {"+", "-", "*"}
    wordings = {re.sub(r"[-\d() ]+[-+*][-\d() ]+", "Q", p[-1]["content"]) for p in data["train"]["prompt"]}
    assert len(wordings) > 1


def test_arithmetic_splits_are_disjoint_including_mirrors():
    data = arithmetic_dataset(num_train=2000, num_test=200, operations=("+", "-"))
    train = set(questions(data["train"]))
    test = questions(data["test"])
    assert len(set(test)) == len(test) == 200
    assert len(train) == 2000  # no duplicate question in train either
    for a, op, b in test:
        assert (a, op, b) not in train
        if op == "+":
            assert (b, op, a) not in train


def test_arithmetic_uses_the_whole_space_when_asked():
    # 0..2 with "-" has exactly 9 questions and no mirrors: all of them are used.
    data = arithmetic_dataset(num_train=6, num_test=3, low=0, high=2, operations=("-",))
    assert sorted(questions(data["train"]) + questions(data["test"])) == sorted(
        (a, "-", b) for a in range(3) for b in range(3)
    )


def test_arithmetic_answers_score_with_accuracy_reward():
    test = arithmetic_dataset(20, 20)["test"]
    assert accuracy_reward(completions=test["answer"], answer=test["answer"]) == [1.0] * 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"low": 5, "high": 4}, "low=5"),
        ({"operations": ("/",)}, "operations"),
        ({"operations": ()}, "operations"),
        ({"operations": ("+", "+")}, "operations"),
        ({"num_train": 0}, "num_train"),
        ({"num_test": -1}, "num_test"),
        ({"num_train": 2.5}, "num_train"),
        ({"num_train": 8, "num_test": 2, "low": 0, "high": 2}, "num_train \\+ num_test"),
        # 0..2 with "+": 9 ordered questions, 6 classes; 3 held out leave fewer than 6 for train.
        ({"num_train": 6, "num_test": 3, "low": 0, "high": 2}, "num_train"),
    ],
)
def test_arithmetic_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        arithmetic_dataset(**{"num_train": 10, "num_test": 5, **kwargs})


# --- countdown ---------------------------------------------------------------------------------------------


def test_countdown_sizes_columns_and_chat_format():
    data = countdown_dataset(num_train=100, num_test=20)
    assert (len(data["train"]), len(data["test"])) == (100, 20)
    assert data["train"].column_names == ["prompt", "target", "nums", "solution"]
    row = data["train"][0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert str(row["nums"]) in row["prompt"][-1]["content"]
    assert f"equals {row['target']}." in row["prompt"][-1]["content"]


@pytest.mark.parametrize("num_numbers", [3, 4])
def test_countdown_every_problem_is_solvable(num_numbers):
    data = countdown_dataset(
        num_train=300, num_test=50, num_numbers=num_numbers, max_number=20, max_target=100
    )
    for split in ("train", "test"):
        for row in data[split]:
            value, used = evaluate_expression(row["solution"])
            assert value == row["target"]
            assert sorted(used) == sorted(row["nums"])
            assert len(row["nums"]) == num_numbers
            assert all(1 <= n <= 20 for n in row["nums"])
            assert 1 <= row["target"] <= 100
        completions = [f"<answer>{s}</answer>" for s in data[split]["solution"]]
        rewards = countdown_reward(
            completions=completions, target=data[split]["target"], nums=data[split]["nums"]
        )
        assert rewards == [1.0] * len(completions)


def test_countdown_deterministic_and_disjoint():
    first, second = countdown_dataset(200, 50, seed=1), countdown_dataset(200, 50, seed=1)
    assert first["train"].to_list() == second["train"].to_list()
    assert first["test"].to_list() == second["test"].to_list()
    assert first["train"].to_list() != countdown_dataset(200, 50, seed=2)["train"].to_list()

    def keys(split):
        return [(tuple(sorted(r["nums"])), r["target"]) for r in split]

    train, test = keys(first["train"]), keys(first["test"])
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_numbers": 1}, "num_numbers"),
        ({"num_numbers": 7}, "num_numbers"),
        ({"max_number": 0}, "max_number"),
        ({"max_target": 0}, "max_target"),
        ({"num_test": 0}, "num_test"),
        ({"num_train": 500, "num_numbers": 2, "max_number": 3, "max_target": 5}, "distinct problems"),
    ],
)
def test_countdown_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        countdown_dataset(**{"num_train": 10, "num_test": 5, **kwargs})


# --- registry ---------------------------------------------------------------------------------------------------


def test_calculator_task_prompts_lead_with_a_worked_episode_and_hold_out_questions():
    data = calculator_dataset(num_train=40, num_test=10, seed=0)
    prompt = data["test"][0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert (
        prompt[2]["content"]
        == '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 56"}}</tool_call>'
    )
    assert prompt[3]["content"] == prompt[4]["content"] == str(1234 * 56)
    question = re.search(r"(\d+) ([-+*]) \(?(-?\d+)\)?", prompt[-1]["content"])
    a, op, b = int(question.group(1)), question.group(2), int(question.group(3))
    assert data["test"][0]["answer"] == str(ARITHMETIC_OPERATIONS[op](a, b))
    assert 100 <= a <= 99999 and 100 <= b <= 99999
    train_questions = {row["prompt"][-1]["content"] for row in data["train"]}
    assert not train_questions & {row["prompt"][-1]["content"] for row in data["test"]}


def test_calculator_tool_is_exact_and_refuses_what_it_cannot_evaluate():
    assert calculator("(12 + 3) * 45") == "675"
    assert calculator("7 / 2") == "7/2"  # exact, as a fraction
    assert calculator("68231 * 4417") == str(68231 * 4417)
    with pytest.raises(ValueError, match="cannot evaluate"):
        calculator("__import__('os')")


def test_tasks_registry():
    assert set(TASKS) == {"arithmetic", "countdown", "calculator"}
    assert TASKS["calculator"].tools == [calculator] and TASKS["arithmetic"].tools == []
    arithmetic, countdown = TASKS["arithmetic"], TASKS["countdown"]
    assert arithmetic.rewards == [accuracy_reward] and arithmetic.accuracy is accuracy_reward
    assert [f.__name__ for f in countdown.rewards] == ["countdown_reward", "format_reward"]
    assert countdown.accuracy is countdown_reward
    for task in TASKS.values():
        data = task.build(num_train=10, num_test=5, seed=0)
        assert (len(data["train"]), len(data["test"])) == (10, 5)
