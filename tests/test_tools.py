"""Tool calling pieces: parsing calls (Hermes, or a response_template), running them, rendering results."""

import asyncio
import json
import time

import pytest
from tiny_models import tiny_tokenizer

from grpo_hf.data.tool_results import is_tool_error
from grpo_hf.episodes.tools import (
    Toolbox,
    ToolCall,
    ToolResultRenderer,
    TurnParser,
    check_tool_call_format,
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
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]  # no arguments


@pytest.mark.parametrize(
    "body",
    ['{"name": "add", "arguments": {"a": 2', '{"arguments": {"a": 2}}', "[1, 2]", '{"name": 3}'],
    ids=["json", "no-name", "not-an-object", "name-not-a-string"],
)
def test_a_turn_with_a_call_that_cannot_be_read_has_no_call(body):
    # As TRL (and vLLM's Hermes parser at inference) read it: the turn is text, the episode ends.
    good = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>") == []
    assert parse_tool_calls(f"{good} <tool_call>{body}</tool_call>") == []


def test_arguments_that_are_not_an_object_make_a_call_that_fails():
    [call] = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert call == ToolCall("add", [1, 2], "the arguments of add must be a JSON object, got [1, 2]")
    [result] = run_tool_calls([call], TOOLS, timeout=5.0)
    assert result.failed and result.message["content"] == (
        '{"error": "the arguments of add must be a JSON object, got [1, 2]"}'
    )


def test_run_tool_calls_gives_one_message_per_call_and_errors_as_json():
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("lookup", {"key": "x"}),  # async def
        ToolCall("add", {"a": 2}),  # missing argument
        ToolCall("broken", {"x": 1}),  # raises
        ToolCall("nope", {}),
    ]
    results = run_tool_calls(calls, TOOLS, timeout=5.0)
    assert [r.message["role"] for r in results] == ["tool"] * 5
    assert [r.message["name"] for r in results] == ["add", "lookup", "add", "broken", "nope"]
    assert [r.failed for r in results] == [False, False, True, True, True]
    assert not any(r.timed_out for r in results)
    contents = [r.message["content"] for r in results]
    assert contents[0] == "5"
    assert contents[1] == '{"key": "x", "found": true}'
    assert json.loads(contents[2])["error"].startswith(
        "wrong arguments for add: missing a required argument: 'b'"
    )
    assert json.loads(contents[3]) == {"error": "broken raised KeyError: 'no such row'"}
    assert json.loads(contents[4]) == {
        "error": "unknown tool 'nope'; the tools are ['add', 'broken', 'lookup']."
    }
    assert [is_tool_error(r.message) for r in results] == [False, False, True, True, True]


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
    results = run_tool_calls(calls, tool_registry([slow, add]), timeout=0.2)
    assert time.perf_counter() - start < 4.0  # the sleeping call was abandoned, not awaited
    assert [r.message["content"] for r in results] == ['{"error": "slow did not return within 0.2 s."}', "2"]
    assert [(r.failed, r.timed_out) for r in results] == [(True, True), (False, False)]


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
    box = Toolbox([add], {None: Counter()})
    environments = [Counter(), Counter()]
    environments[0].reset(start=10)
    environments[1].reset(start=20)
    tools = box.for_episodes(environments, 2)
    calls = [
        [ToolCall("push", {"x": 1}), ToolCall("push", {"x": 2}), ToolCall("add", {"a": 2, "b": 2})],
        [],
        # the second episode has no call here; its environment stays as reset made it
    ]
    results = run_episode_calls(calls, tools, timeout=5.0)
    assert [r.message["content"] for r in results[0]] == ["[10, 1]", "[10, 1, 2]", "4"]
    assert results[1] == []
    assert environments[0].log == [10, 1, 2] and environments[1].log == [20]
    assert [s["function"]["name"] for s in box.schemas[None]] == ["add", "push"]


class Scored(Counter):
    def get_reward(self) -> float:
        return float(len(self.log))


def test_toolbox_gives_each_environment_its_own_tools_and_never_reset_or_get_reward():
    class Quiet:
        def reset(self, **kwargs) -> None:
            pass

    box = Toolbox([add], {"count": Scored(), "quiet": Quiet()})
    assert [s["function"]["name"] for s in box.schemas["count"]] == ["add", "push"]
    assert [s["function"]["name"] for s in box.schemas["quiet"]] == ["add"]
    assert [t.__name__ for t in box.tools] == ["add", "push"]
    assert Toolbox(None, {None: Quiet()}).tools == []  # an environment may have no tool


def undocumented(x):
    return x


def test_toolbox_rejects_clashing_names_and_undescribable_tools():
    def push(x: int) -> str:
        """Shadows the environment's method.

        Args:
            x: The value.
        """
        return ""

    with pytest.raises(ValueError, match=r"\['push'\] are both in tools= and methods of an environment"):
        Toolbox([push], {None: Counter()})
    with pytest.raises(ValueError, match="cannot describe 'undocumented' to the model"):
        Toolbox([undocumented])


def test_tool_results_render_as_the_chat_template_writes_them_after_a_turn_ending_in_eos():
    tokenizer = tiny_tokenizer()
    render = ToolResultRenderer(tokenizer)
    ids = render([{"role": "tool", "name": "add", "content": "5"}])
    # The template writes "...A<|im_end|>\n"; the model generated up to <|im_end|>, so "\n" comes first.
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_tools_go_into_the_system_message_when_the_template_ignores_them():
    tokenizer = tiny_tokenizer()  # its template never reads `tools`
    schemas = Toolbox([add]).schemas[None]
    assert render_tool_prompt(tokenizer, [{"role": "user", "content": "2+3?"}], []) == (
        "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"  # no tools: the prompt as it is
    )
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


# ---- Reading a turn: Hermes, or the tokenizer's response_template --------------------------------

CALL_TEMPLATE = {  # a made-up call format, <call>{json}</call>, as transformers' response parsing reads it
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<call>",
            "close_pattern": r"</call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def turn(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """A turn's tokens (ending in EOS) and its context (a one-message chat prompt)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], prompt


def test_a_hermes_turn_becomes_content_and_tool_calls_as_transformers_writes_them():
    tokenizer = tiny_tokenizer()
    parse = TurnParser(tokenizer)
    message, calls = parse(
        *turn(tokenizer, 'Adding. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'), []
    )
    assert calls == [ToolCall("add", {"a": 2, "b": 3})]
    assert message == {
        "role": "assistant",
        "content": "Adding.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    broken = 'Adding. <tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    assert parse(*turn(tokenizer, broken), []) == ({"role": "assistant", "content": broken}, [])


def test_a_response_template_reads_calls_in_the_models_own_format_typed_by_the_schemas():
    tokenizer = tiny_tokenizer()
    tokenizer.response_template = CALL_TEMPLATE
    parse = TurnParser(tokenizer)
    schemas = Toolbox([add]).schemas[None]
    message, calls = parse(
        *turn(tokenizer, 'Sure. <call>{"name": "add", "arguments": {"a": 2, "b": "3"}}</call>'), schemas
    )
    assert calls == [ToolCall("add", {"a": 2, "b": 3})]  # "3" typed as the schema's integer
    assert message == {
        "role": "assistant",
        "content": "Sure.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    assert parse(*turn(tokenizer, "5"), schemas) == ({"role": "assistant", "content": "5"}, [])
    for broken in [
        '<call>{"name": "add", "arguments": {"a": 2</call>',
        '<call>{"arguments": {"a": 2}}</call>',
    ]:
        assert parse(*turn(tokenizer, broken), schemas) == ({"role": "assistant", "content": broken}, [])


def test_a_template_writing_calls_in_another_format_needs_a_response_template():
    tokenizer = tiny_tokenizer()
    check_tool_call_format(tokenizer)  # its template drops tool calls: the system prompt teaches Hermes
    hermes = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.chat_template = hermes
    check_tool_call_format(tokenizer)
    tokenizer.chat_template = hermes.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    with pytest.raises(ValueError, match="format other than Hermes .* Set tokenizer.response_template"):
        check_tool_call_format(tokenizer)
    tokenizer.response_template = CALL_TEMPLATE
    check_tool_call_format(tokenizer)
