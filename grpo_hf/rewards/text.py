"""Completion text for reward functions: the text of a completion and its final answer.

A completion is a str (plain-text prompt) or a list of chat messages; `completion_text` joins a
chat's contents, `final_answer_text` keeps the model's last turn (a tool result is not an answer),
and `extract_answer` finds the final answer in free text.
"""

import re


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion: the str itself, or the joined contents of its chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(_message_text(message.get("content")) for message in completion)
    raise TypeError(f"A completion is a str or a list of chat messages, got {type(completion).__name__}.")


def final_answer_text(completion: str | list[dict]) -> str:
    """The text that holds a completion's answer: the str itself, or its last assistant message
    (in a multi-turn completion, the model's last turn, not a tool result)."""
    if isinstance(completion, list):
        turns = [m for m in completion if m.get("role", "assistant") == "assistant"]
        return _message_text(turns[-1].get("content")) if turns else ""
    return completion_text(completion)


def _message_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Multimodal messages: a list of parts such as {"type": "text", "text": "..."}.
    return "".join(part.get("text") or "" for part in content if isinstance(part, dict))


# ---------------------------------------------------------------------------------------------------
# Final-answer extraction
# ---------------------------------------------------------------------------------------------------

_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# An ASCII number not glued to a word or a decimal point before it: "-8", "1,234", "3.5", "3/4".
_NUMBER = re.compile(r"(?<![\w.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
WORD = re.compile(r"[A-Za-z]{2,}")


def answer_tag_content(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>` pair, or None if there is none."""
    close = text.rfind(_CLOSE_TAG)
    start = text.rfind(_OPEN_TAG, 0, close) if close >= 0 else -1
    return text[start + len(_OPEN_TAG) : close] if start >= 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer of free text, or None.

    Rules, first that applies:
    1. If the text has a complete `<answer>...</answer>` pair, only the last pair's content is
       looked at (the model declared its answer there; the rest of the text is ignored).
    2. The content of the last well-formed `\\boxed{...}` (nested braces allowed).
    3. The whole region, if it is a bare one-line expression: no `=`, no word of two or more letters
       outside LaTeX commands ("82", "-8", "\\frac{1}{2}", "$0.5$.").
    4. The last number: "37 + 45 = 82" -> "82", "The answer is 82." -> "82", "1,234" -> "1234".
    """
    tagged = answer_tag_content(text)
    region = text if tagged is None else tagged
    boxed = _last_boxed(region)
    if boxed is not None:
        return boxed.strip() or None
    bare = region.strip().strip("$").strip().rstrip(".").strip().strip("$").strip()
    is_one_expression = "\n" not in bare and "=" not in bare and not _BOXED.search(bare)
    if bare and is_one_expression and not WORD.search(LATEX_COMMAND.sub(" ", bare)):
        return bare
    numbers = _NUMBER.findall(region)
    return numbers[-1].replace(",", "") if numbers else None


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]  # index just after each "\boxed{"
    if not starts:
        return None
    closing, stack = {}, []
    for i, char in enumerate(text):  # one pass matches every brace, so this stays linear
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            closing[stack.pop()] = i
    for start in reversed(starts):
        if start - 1 in closing:
            return text[start : closing[start - 1]]
    return None
