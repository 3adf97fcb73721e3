"""TRL 1.16's `trl.rewards` under the same names in `grpo_hf.rewards`: TRL's docstring examples give
the same values here, and the cases TRL documents (skipped rows, incomplete reasoning, bounds)."""

import math

import pytest

from grpo_hf.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_accuracy_reward_reads_trl_solution_column_positionally_and_by_keyword():
    # TRL's docstring example: accuracy_reward(completions, solutions) -> [1.0, 0.0]
    completions = [chat(r"My answer is \boxed{\frac{1}{3}}"), chat(r"My answer is \boxed{\frac{1}{2}}")]
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}"]
    assert accuracy_reward(completions, solutions) == [1.0, 0.0]
    assert accuracy_reward(completions=completions, solution=solutions) == [1.0, 0.0]
    assert accuracy_reward(completions=completions, answer=solutions) == [1.0, 0.0]


def test_accuracy_reward_needs_a_gold_column_and_prefers_trls_solution():
    with pytest.raises(ValueError, match="'solution' or an 'answer' column.*neither"):
        accuracy_reward(completions=[chat("1")])
    # A dataset with both (OpenR1-Math has a worked 'solution' and an 'answer'): TRL scores 'solution'.
    assert accuracy_reward(completions=[chat("1")], answer=["2"], solution=["1"]) == [1.0]


def test_accuracy_reward_logs_gold_and_parsed_answer_through_log_extra():
    logged = {}
    rewards = accuracy_reward(
        completions=[chat("It is 82."), chat("no idea")],
        solution=["82", "82"],
        log_extra=lambda column, values: logged.__setitem__(column, values),
    )
    assert rewards == [1.0, 0.0]
    assert logged == {"solution": ["82", "82"], "answer_parsed": ["82", "[unparseable]"]}


def test_reasoning_accuracy_reward_trl_example():
    # TRL's docstring example: [1.0, 0.0, 0.0]; the third never closes its reasoning.
    completions = [
        chat(r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{3}}"),
        chat(r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{2}}"),
        chat(r"<think> Reasoning content with partial answers \boxed{\frac{1}{3}} but no final answer"),
    ]
    solutions = [r"\frac{1}{3}"] * 3
    assert reasoning_accuracy_reward(completions, solution=solutions, reasoning_delimiters=["</think>"]) == [
        1.0,
        0.0,
        0.0,
    ]


def test_reasoning_accuracy_reward_reads_after_the_last_delimiter_and_skips_unreadable_gold():
    # The answer inside the reasoning (7) is not the final one (9).
    text = "<think>maybe 7</think> no wait <think>it is 9</think> The answer is 9."
    assert reasoning_accuracy_reward([chat(text)], solution=["9"]) == [1.0]
    assert reasoning_accuracy_reward([chat(text)], solution=["7"]) == [0.0]
    assert reasoning_accuracy_reward([chat("<think>x</think> 9")], solution=[None]) == [None]
    # Incomplete reasoning scores 0.0 even when the gold is unreadable: it is penalised, not skipped.
    assert reasoning_accuracy_reward([chat("<think>x 9")], solution=[None]) == [0.0]


def test_cosine_scaled_reward_trl_example_and_bounds():
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward.__name__ == "cosine_scaled_reward"
    completions = [chat(r"\boxed{\frac{1}{3}}"), chat(r"\boxed{\frac{1}{2}}")]
    # Half of max_len: cos(pi / 2) = 0, so the midpoints: right (0.5 + 1) / 2 = 0.75, wrong -0.75.
    values = reward(completions=completions, solution=[r"\frac{1}{3}"] * 2, completion_ids=[[1] * 50] * 2)
    assert values == pytest.approx([0.75, -0.75])
    # Length 0: cos 0 = 1 -> right max 1.0, wrong min -1.0; past max_len the bound holds: 0.5 and -0.5.
    short = reward(completions=completions, solution=[r"\frac{1}{3}"] * 2, completion_ids=[[], []])
    long = reward(completions=completions, solution=[r"\frac{1}{3}"] * 2, completion_ids=[[1] * 300] * 2)
    assert short == pytest.approx([1.0, -1.0]) and long == pytest.approx([0.5, -0.5])
    # A quarter: right 0.5 + 0.25 * (1 + cos(pi/4)) = 0.5 + 0.25 * 1.70711 = 0.92678.
    quarter = reward(completions=completions[:1], answer=[r"\frac{1}{3}"], completion_ids=[[1] * 25])
    assert quarter == pytest.approx([0.5 + 0.25 * (1 + math.cos(math.pi / 4))])
    assert reward(completions=completions[:1], solution=[None], completion_ids=[[1]]) == [None]
    with pytest.raises(ValueError, match="max_len"):
        get_cosine_scaled_reward(max_len=0)


def test_think_format_reward_trl_example():
    completions = [
        chat("<think>\nThis is my reasoning.\n</think>\nThis is my answer."),
        chat("<think>\nThis is my reasoning.\nThis is my answer."),
        chat("<think>a</think><think>b</think>"),  # a second <think> block
        "<think>plain text completions work too</think> 3",
    ]
    assert think_format_reward(completions) == [1.0, 0.0, 0.0, 1.0]


def test_repetition_penalty_reward_trl_example():
    reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert reward.__name__ == "repetition_penalty_reward"
    # [5]*5 has 4 bigrams, 1 unique: (1 - 1/4) * -1 = -0.75; a completion shorter than n: 0.0.
    assert reward(completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5], [7]]) == [0.0, -0.75, 0.0]
    # Trigrams of [1,2,1,2,1,2]: (1,2,1) (2,1,2) (1,2,1) (2,1,2): 2 unique of 4 -> 0.5 * -2 = -1.0.
    assert get_repetition_penalty_reward(3, -2.0)(completion_ids=[[1, 2, 1, 2, 1, 2]]) == [-1.0]
    with pytest.raises(ValueError, match="max_penalty"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_soft_overlong_punishment_trl_example_and_name():
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward.__name__ == "soft_overlong_punishment_reward"
    # 90 tokens: (100 - 20 - 90) / 20 = -0.5; 80: 0.0; 101: -1.0.
    assert reward(completion_ids=[[1] * 90, [1] * 80, [1] * 101]) == [-0.5, 0.0, -1.0]
