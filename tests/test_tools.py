"""Tool calling pieces: parsing Hermes-format calls, running them, masking tool results."""

import asyncio
import time

import pytest
from tiny_models import tiny_tokenizer

from grpo_hf.tools import (
    Toolbox,
    ToolCall,
    ToolResultRenderer,
    parse_tool_calls,
    render_tool_prompt,
    run_episode_calls,
    run_tool_calls,
    tool_registry,
)


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def lookup(key: str) -> dict:
    await asyncio.sleep(0)
    return {"key": key, "found": True}


def broken(x: int) -> str:
    raise KeyError("no such row")


TOOLS = tool_registry([add, lookup, broken])


def test_parse_two_calls_in_order_with_text_around_them():
    text = (
        'Let me compute. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        ' and <tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}</tool_call> done'
    )
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("lookup", {"key": "x"})]
    assert parse_tool_calls("no call here, <tool_call> unclosed") == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "add", "arguments": {"a": 2', "not valid JSON"),
        ('{"arguments": {"a": 2}}', 'needs {"name": str, "arguments": object}'),
        ('{"name": "add", "arguments": [1, 2]}', 'needs {"name": str, "arguments": object}'),
        ("[1, 2]", 'needs {"name": str, "arguments": object}'),
    ],
    ids=["json", "no-name", "list-arguments", "not-an-object"],
)
def test_a_malformed_call_carries_its_error(body, error):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert error in call.error


def test_run_tool_calls_gives_one_message_per_call_and_errors_as_text():
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("lookup", {"key": "x"}),  # async def
        ToolCall("add", {"a": 2}),  # missing argument
        ToolCall("broken", {"x": 1}),  # raises
        ToolCall("nope", {}),
        ToolCall("", {}, error="the tool call is not valid JSON"),
    ]
    messages = run_tool_calls(calls, TOOLS, timeout=5.0)
    assert [m["role"] for m in messages] == ["tool"] * 6
    assert [m["name"] for m in messages] == ["add", "lookup", "add", "broken", "nope", ""]
    contents = [m["content"] for m in messages]
    assert contents[0] == "5"
    assert contents[1] == '{"key": "x", "found": true}'
    assert contents[2].startswith("Error: wrong arguments for add: missing a required argument: 'b'")
    assert contents[3] == "Error: broken raised KeyError: 'no such row'"
    assert contents[4] == "Error: unknown tool 'nope'; the tools are ['add', 'broken', 'lookup']."
    assert contents[5] == "Error: the tool call is not valid JSON"


def test_tool_registry_rejects_duplicates_and_non_functions():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        tool_registry([add, add])
    with pytest.raises(ValueError, match="is not a named function"):
        tool_registry([3])


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def test_a_call_past_the_timeout_becomes_an_error_and_the_next_call_still_runs():
    calls = [ToolCall("slow", {"seconds": 5.0}), ToolCall("add", {"a": 1, "b": 1})]
    start = time.perf_counter()
    messages = run_tool_calls(calls, tool_registry([slow, add]), timeout=0.2)
    assert time.perf_counter() - start < 4.0  # the sleeping call was abandoned, not awaited
    assert [m["content"] for m in messages] == ["Error: slow did not return within 0.2 s.", "2"]


class Counter:
    """An environment: its state changes with each call, so the order of calls shows."""

    def __init__(self):
        self.log = []

    def reset(self, start: int, **kwargs) -> None:
        self.log = [start]

    def push(self, x: int) -> str:
        """Appends x.

        Args:
            x: The value.
        """
        self.log.append(x)
        return str(self.log)


def test_episode_calls_run_in_order_within_an_episode_with_each_episodes_tools():
    box = Toolbox([add], Counter)
    tools, environments = box.for_episodes([{"prompt": [], "start": 10}, {"prompt": [], "start": 20}])
    calls = [
        [ToolCall("push", {"x": 1}), ToolCall("push", {"x": 2}), ToolCall("add", {"a": 2, "b": 2})],
        [],
        # the second episode has no call here; its environment stays as reset made it
    ]
    results = run_episode_calls(calls, tools, timeout=5.0)
    assert [m["content"] for m in results[0]] == ["[10, 1]", "[10, 1, 2]", "4"]
    assert results[1] == []
    assert environments[0].log == [10, 1, 2] and environments[1].log == [20]
    assert [s["function"]["name"] for s in box.schemas] == ["add", "push"]


def undocumented(x):
    return x


def test_toolbox_rejects_clashing_names_undescribable_tools_and_no_tools():
    def push(x: int) -> str:
        """Shadows the environment's method.

        Args:
            x: The value.
        """
        return ""

    with pytest.raises(ValueError, match=r"\['push'\] are both in tools= and methods of the environment"):
        Toolbox([push], Counter)
    with pytest.raises(ValueError, match="cannot describe 'undocumented' to the model"):
        Toolbox([undocumented], None)
    with pytest.raises(ValueError, match="give no tool"):
        Toolbox([], lambda: object())


def test_tool_results_render_as_the_chat_template_writes_them_after_a_turn_ending_in_eos():
    tokenizer = tiny_tokenizer()
    render = ToolResultRenderer(tokenizer)
    ids = render([{"role": "tool", "name": "add", "content": "5"}])
    # The template writes "...A<|im_end|>\n"; the model generated up to <|im_end|>, so "\n" comes first.
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_tools_go_into_the_system_message_when_the_template_ignores_them():
    tokenizer = tiny_tokenizer()  # its template never reads `tools`
    schemas = Toolbox([add], None).schemas
    text = render_tool_prompt(tokenizer, [{"role": "user", "content": "2+3?"}], schemas)
    assert text.startswith(
        "<|im_start|>system\nYou can call these tools:\n- add(a: integer, b: integer): Adds two numbers.\n"
    )
    assert "<tool_call>" in text
    assert text.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    with_system = render_tool_prompt(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}], schemas
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:")
    # A template that renders `tools` itself gets them as they are.
    tokenizer.chat_template = (
        "{% if tools %}{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{% endif %}"
    ) + tokenizer.chat_template
    assert render_tool_prompt(tokenizer, [{"role": "user", "content": "hi"}], schemas).startswith(
        "[add]<|im_start|>user"
    )
