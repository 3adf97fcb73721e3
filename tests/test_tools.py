"""Tool calling pieces: parsing Hermes-format calls, running them, masking tool results."""

import asyncio

import pytest

from grpo_hf.tools import ToolCall, join_turns, parse_tool_calls, run_tool_calls, tool_registry


def add(a: int, b: int) -> int:
    """Adds two numbers."""
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
    messages = run_tool_calls(calls, TOOLS)
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


def test_join_turns_masks_tool_results_out_of_the_loss():
    # model turn (3 tokens), tool result (2 tokens), model turn (2 tokens)
    ids, mask = join_turns([([11, 12, 13], True), ([90, 91], False), ([14, 2], True)], max_length=16)
    assert ids == [11, 12, 13, 90, 91, 14, 2]
    assert mask == [1, 1, 1, 0, 0, 1, 1]
    assert join_turns([([11, 12, 13], True), ([90, 91], False), ([14, 2], True)], max_length=4) == (
        [11, 12, 13, 90],
        [1, 1, 1, 0],
    )
