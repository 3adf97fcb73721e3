"""Built-in reward functions: pure, no I/O, never raising on model text.

Contract (the trainer's, see `grpo_hf.rewards.scoring`): a reward function is called with keyword arguments
only, `f(prompts=..., completions=..., completion_ids=..., **dataset_columns)`, and returns one
float per completion, or None where it does not apply. A completion is a str (plain-text prompt) or
a list of chat messages (`completion_text` turns either into text). Parameterised rewards come from
`make_<x>_reward(...)` (or TRL's `get_<x>(...)`); the returned function's `__name__` is the metric
name. Everything TRL 1.16 has in `trl.rewards` is here under the same name, so a TRL script's
`from trl.rewards import ...` becomes `from grpo_hf.rewards import ...`.

- `accuracy`: the final answer checked with math-verify against the `solution` (TRL's column) or
  `answer` column: `accuracy_reward`, `reasoning_accuracy_reward` (after `</think>`),
  `get_cosine_scaled_reward` (correctness scaled by length).
- `form`: `make_format_reward` (a regex), `think_format_reward`, `make_overlong_reward` /
  `get_soft_overlong_punishment` (DAPO, arXiv 2503.14476), `get_repetition_penalty_reward`,
  `tool_use_reward` (a tool call that returned without error).
- `countdown`: `countdown_reward` and `evaluate_expression` (exact arithmetic without `eval`).
- `text`: a completion's text and its final answer (`extract_answer`).
"""

from grpo_hf.rewards.accuracy import accuracy_reward, get_cosine_scaled_reward, reasoning_accuracy_reward
from grpo_hf.rewards.countdown import countdown_reward, evaluate_expression, extract_equation
from grpo_hf.rewards.form import (
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    make_format_reward,
    make_overlong_reward,
    think_format_reward,
    tool_use_reward,
)
from grpo_hf.rewards.text import answer_tag_content, completion_text, extract_answer, final_answer_text

__all__ = [
    "accuracy_reward",
    "answer_tag_content",
    "completion_text",
    "countdown_reward",
    "evaluate_expression",
    "extract_answer",
    "extract_equation",
    "final_answer_text",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "make_format_reward",
    "make_overlong_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "tool_use_reward",
]
