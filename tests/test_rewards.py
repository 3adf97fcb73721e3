"""Reward functions: hand-picked cases, hostile inputs, and one property test."""

import threading
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_hf.rewards import (
    accuracy_reward,
    completion_text,
    countdown_reward,
    evaluate_expression,
    extract_answer,
    extract_equation,
    make_format_reward,
    make_overlong_reward,
    tool_use_reward,
)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def accuracy(text, gold: str = "82") -> float | None:
    return accuracy_reward(completions=[text], answer=[gold])[0]


def countdown(text, target: int = 24, nums: tuple = (2, 3, 4)) -> float | None:
    return countdown_reward(completions=[text], target=[target], nums=[list(nums)])[0]


# --- completion_text ---------------------------------------------------------------------------------


def test_completion_text_plain_chat_and_parts():
    assert completion_text("82") == "82"
    assert completion_text(chat("82")) == "82"
    assert (
        completion_text(
            [{"role": "assistant", "content": [{"type": "text", "text": "8"}, {"type": "text", "text": "2"}]}]
        )
        == "82"
    )
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    with pytest.raises(TypeError, match="str or a list"):
        completion_text(82)


# --- answer extraction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("82", "82"),
        ("  82.\n", "82"),
        ("-8", "-8"),
        ("37 + 45 = 82", "82"),
        ("The answer is 82.", "82"),
        ("37 + 45 is 82 apples", "82"),
        ("\\boxed{82}", "82"),
        ("So \\boxed{80} no wait \\boxed{82}.", "82"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ {82} }", "{82}"),
        ("\\boxed{82", "82"),  # unclosed box: fall back to the last number
        ("<answer>82</answer>", "82"),
        ("I think 80. <answer>82</answer> 99", "82"),  # the tag wins over numbers outside it
        ("<answer>80</answer> then <answer>82</answer>", "82"),  # the last tag wins
        ("<answer>The answer is 82.</answer>", "82"),
        ("<answer>37 + 45 = 82</answer>", "82"),
        ("<answer>\\boxed{82}</answer>", "82"),
        ("<answer>82", "82"),  # unclosed tag is ignored
        ("<answer>eighty-two</answer> 82", None),  # a tag is final even when it holds no number
        ("$\\frac{1}{2}$", "\\frac{1}{2}"),
        ("The total is 1,234.", "1234"),
        ("It is 3/4", "3/4"),
        ("45-8", "45-8"),  # a bare expression is kept whole
        ("So it is 45-8", "8"),
        ("No numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# --- accuracy_reward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "82",
        "37 + 45 = 82",
        "The answer is 82.",
        "\\boxed{82}",
        "<answer>82</answer>",
        "<answer> 82 </answer>",
        "82.0",
        "\\boxed{\\frac{164}{2}}",
        "\\boxed{82 \\text{ cm}}",
        "\\boxed{x = 82}",
    ],
)
def test_accuracy_correct(text):
    assert accuracy(text) == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "81",
        "The answer is 83.",
        "\\boxed{-82}",
        "<answer>81</answer> 82",
        "82.5",
        "",
        "   ",
        "no idea",
        "<answer></answer>",
        "\\boxed{}",
        "{" * 500,
        "\\boxed{" + "{" * 30 + "82" + "}" * 30 + "}",
    ],
)
def test_accuracy_wrong_or_unparsable(text):
    assert accuracy(text) == 0.0


def test_accuracy_other_golds():
    assert accuracy("-8", gold="-8") == 1.0
    assert accuracy("\\boxed{0.5}", gold="\\frac{1}{2}") == 1.0
    assert accuracy("The answer is 1,234.", gold="1234") == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "9" * 5000,  # huge number
        "\\boxed{9^{9^{9^{9}}}}",  # hangs SymPy without a timeout
        "\\boxed{10^{10^{10}}}",
        "<answer>9**9**9</answer>",
        "\\boxed{(10^{8})!}",
        "\\boxed{\\binom{10^{9}}{10^{5}}}",
        "\\boxed{binomial(10**9, 10**5)}",
        "\\boxed{" + "{" * 20 + "1" + "}" * 20 + "}",  # nested sets: minutes in math-verify
        "\\boxed{" + "(" * 40 + "82" + ")" * 40 + "}",
        "x\\boxed{" * 2000,  # many unclosed boxes
        "<answer>" * 3000 + "81",
        "".join(chr(33 + (i * 7919) % 90) for i in range(10_000)),  # 10k characters of garbage
    ],
)
def test_accuracy_pathological_is_fast_zero(text):
    start = time.perf_counter()
    assert accuracy(text) == 0.0
    assert time.perf_counter() - start < 2.0


def test_accuracy_chat_completions_and_lengths():
    completions = [chat("82"), chat("81"), chat("<answer>7</answer>")]
    assert accuracy_reward(
        completions=completions, answer=["82", "82", "7"], prompts=None, completion_ids=None
    ) == [
        1.0,
        0.0,
        1.0,
    ]


def test_accuracy_output_has_one_float_per_completion():
    texts = ["82", "", "x", "\\boxed{82}", "9" * 300]
    rewards = accuracy_reward(completions=texts, answer=["82"] * len(texts))
    assert len(rewards) == len(texts)
    assert all(type(r) is float for r in rewards)


def test_accuracy_missing_or_unreadable_gold_does_not_apply():
    assert accuracy_reward(completions=["82", "82"], answer=[None, ""]) == [None, None]


def test_accuracy_works_outside_the_main_thread():
    # math-verify's own signal-based timeouts raise ValueError in a thread; ours are off.
    results = []
    thread = threading.Thread(
        target=lambda: results.append(accuracy_reward(completions=["82", "1"], answer=["82"] * 2))
    )
    thread.start()
    thread.join(timeout=30)
    assert results == [[1.0, 0.0]]


# --- format reward -----------------------------------------------------------------------------------------


def test_format_reward_default():
    reward = make_format_reward()
    assert reward.__name__ == "format_reward"
    texts = [
        "<answer>82</answer>",
        "  <answer>\n82\n</answer>\n",
        "82",
        "Sure! <answer>82</answer>",
        "<answer>82",
        "",
    ]
    assert reward(completions=texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert reward(completions=[chat("<answer>1</answer>")]) == [1.0]


def test_format_reward_custom_pattern_and_name():
    reward = make_format_reward(r"<think>.*?</think>\s*<answer>.*?</answer>", name="think_format")
    assert reward.__name__ == "think_format"
    assert reward(completions=["<think>a\nb</think> <answer>1</answer>", "<answer>1</answer>"]) == [1.0, 0.0]


def test_format_reward_errors():
    with pytest.raises(ValueError, match="pattern"):
        make_format_reward("(")
    with pytest.raises(ValueError, match="name"):
        make_format_reward(name="not a name")


# --- overlong reward -----------------------------------------------------------------------------------------


def test_overlong_reward_boundaries():
    reward = make_overlong_reward(max_completion_length=100, soft_cache=20)
    assert reward.__name__ == "overlong_reward"
    lengths = [0, 80, 81, 90, 99, 100, 101, 500]
    # 0 up to 100 - 20 = 80; then (80 - len) / 20; -1 beyond 100.
    expected = [0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0]
    got = reward(completions=[""] * len(lengths), completion_ids=[[7] * n for n in lengths])
    assert got == pytest.approx(expected)


def test_overlong_reward_hard_cut():
    reward = make_overlong_reward(max_completion_length=4, soft_cache=0)
    assert reward(completion_ids=[[1] * 4, [1] * 5]) == [0.0, -1.0]


@pytest.mark.parametrize(
    ("max_len", "cache", "error", "match"),
    [
        (0, 0, ValueError, "max_completion_length"),
        (10, 11, ValueError, "soft_cache"),
        (10, -1, ValueError, "soft_cache"),
        (10.0, 2, TypeError, "max_completion_length"),
        (10, True, TypeError, "soft_cache"),
    ],
)
def test_overlong_reward_errors(max_len, cache, error, match):
    with pytest.raises(error, match=match):
        make_overlong_reward(max_len, cache)


# --- countdown ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>(3 + 5) * 7</answer>", "(3 + 5) * 7"),
        ("<answer>(3 + 5) * 7 = 56</answer>", "(3 + 5) * 7"),
        ("<answer>The equation is (3 + 5) * 7.</answer>", "(3 + 5) * 7"),
        ("<answer>(3 + 5) × 7</answer>", "(3 + 5) * 7"),
        ("Let me try.\n(3 + 5) * 7 = 56\nDone", "(3 + 5) * 7"),
        ("no digits at all", None),
    ],
)
def test_extract_equation(text, expected):
    assert extract_equation(text) == expected


def test_evaluate_expression_exact():
    assert evaluate_expression("(3 + 5) * 7") == (Fraction(56), [3, 5, 7])
    assert evaluate_expression("1 / 3 * 3") == (Fraction(1), [1, 3, 3])  # exact, no float rounding


def test_countdown_correct_and_wrong():
    assert countdown("<answer>2 * 3 * 4</answer>") == 1.0
    assert countdown("<answer>(4 * 3) * 2</answer>") == 1.0
    assert countdown("<answer>4 * (3 + 2)</answer>") == 0.0  # 20, not 24
    assert countdown("I get\n2 * 3 * 4 = 24") == 1.0
    assert countdown(chat("<answer>2*3*4</answer>")) == 1.0
    assert countdown("<answer>(8 / 3) * 3</answer>", target=8, nums=(8, 3, 3)) == 1.0  # fractions in between


@pytest.mark.parametrize(
    "text",
    [
        "<answer>__import__('os').system('x')</answer>",
        "<answer>9**9**9</answer>",
        "<answer>2 ** 3 * 3</answer>",
        "<answer>1/0</answer>",
        "<answer>2 * 3 * 4 / (4 - 4)</answer>",
        "<answer>" + "(" * 500 + "2*3*4" + ")" * 500 + "</answer>",
        "<answer>" + "(" * 500 + "</answer>",
        "<answer>x * 3 * 4</answer>",
        "<answer>(lambda: 24)()</answer>",
        "<answer>[2, 3, 4]</answer>",
        "<answer>24</answer>",  # the target alone uses none of the numbers
        "<answer>6 * 4</answer>",  # 6 is not given
        "<answer>2 * 3 * 4 * 1</answer>",  # 1 is not given
        "<answer>2 * 3 * 4 + 2 - 2</answer>",  # 2 used three times
        "<answer>3 * 4 * 2 * (4 / 4)</answer>",  # 4 reused
        "<answer>2 * 3 * 4.0</answer>",
        "<answer>-(-2) * 3 * 4</answer>",  # unary minus is not a Countdown operation
        "<answer>True * 2 * 3 * 4</answer>",
        "",
        "<answer></answer>",
    ],
)
def test_countdown_rejects(text):
    assert countdown(text) == 0.0


def test_evaluate_expression_rejects_without_raising():
    for expression in [
        "__import__('os')",
        "9**9**9",
        "0x2 * 3 * 4",
        "2_0 + 4",
        "1/0",
        "(" * 500,
        "a",
        "(lambda: 1)()",
        "1" * 201,
        "1 2",
        "",
    ]:
        assert evaluate_expression(expression) is None


def test_countdown_missing_columns_do_not_apply():
    assert countdown_reward(completions=["<answer>1</answer>"] * 2, target=[None, 1], nums=[[1], None]) == [
        None,
        None,
    ]


# --- property --------------------------------------------------------------------------------------------------

_HOSTILE = st.lists(
    st.sampled_from(
        list("0123456789+-*/^()[]{}=.,!$% \nxe") + ["\\boxed{", "\\frac", "<answer>", "</answer>", "**"]
    ),
    max_size=60,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(st.text(max_size=300), _HOSTILE))
def test_rewards_never_raise_and_are_binary(text):
    assert set(accuracy_reward(completions=[text, chat(text)], answer=["82", "\\frac{1}{2}"])) <= {0.0, 1.0}
    assert set(countdown_reward(completions=[text, chat(text)], target=[24, 24], nums=[[2, 3, 4]] * 2)) <= {
        0.0,
        1.0,
    }


def test_tool_use_reward_needs_a_tool_result_that_is_not_an_error():
    call = {"role": "assistant", "content": "<tool_call>...</tool_call>"}
    completions = [
        [call, {"role": "tool", "content": "69104"}, {"role": "assistant", "content": "69104"}],
        [
            call,
            {"role": "tool", "content": '{"error": "unknown tool \'calc\'"}'},
            {"role": "assistant", "content": "1"},
        ],
        [{"role": "assistant", "content": "69104"}],
        "69104",
    ]
    assert tool_use_reward(completions=completions) == [1.0, 0.0, 0.0, 0.0]


def test_accuracy_reads_the_last_assistant_turn_not_a_tool_result():
    episode = [
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": "42"},
    ]
    assert accuracy_reward(completions=[episode], answer=["42"]) == [0.0]
    assert accuracy_reward(
        completions=[[*episode, {"role": "assistant", "content": "42"}]], answer=["42"]
    ) == [1.0]


@pytest.mark.parametrize(
    ("answer_text", "gold", "score"),
    [
        ("37 + 45", "82", 0.0),  # the question restated: equal in value, not an answer
        ("12266 * 80019", str(12266 * 80019), 0.0),
        ("(3+4)*2", "14", 0.0),
        ("2 \\times 7", "14", 0.0),
        ("37 + 45 = 82", "82", 1.0),  # worked, then answered: the last number counts
        ("-8", "-8", 1.0),
        ("3/4", "0.75", 1.0),  # a fraction is an answer
        ("\\frac{1}{2}", "0.5", 1.0),
        ("x^2+1", "x^2+1", 1.0),  # a symbolic gold keeps its operators
    ],
)
def test_an_unevaluated_expression_is_not_a_numeric_answer(answer_text, gold, score):
    assert accuracy_reward(completions=[answer_text], answer=[gold]) == [score]
