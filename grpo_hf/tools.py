"""Tool calling pieces for multi-turn rollouts: parse a turn's tool calls, run them, mask their results.

What is here, and what is not yet: the three pure steps a multi-turn rollout needs between
generation passes, each tested on its own. They are not wired into `GRPOTrainer` yet (there is no
`tools=` argument): the generation loop that feeds tool results back to the model is the next step.

- `parse_tool_calls`: tool calls in the Hermes format (Qwen2.5's and Hermes' chat templates),
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, each parsed on its own; a malformed
  call becomes a `ToolCall` carrying the error, not an exception, since a policy in training
  writes malformed calls and is better told so in the tool message than stopped.
- `run_tool_calls`: each call against the given Python functions (plain or `async def`) ->
  `{"role": "tool", "name": ..., "content": ...}` messages; an unknown tool, bad arguments or a
  raising tool give an "Error: ..." message, so one bad call never stops training.
- `join_turns`: a completion made of the model's turns and the tool results between them ->
  token ids and a loss mask that is 0 on tool-result tokens (the model did not choose them, so
  they get no policy gradient; they stay in the attention mask as context).
"""

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: the tool's name and keyword arguments, or why the call could not be read."""

    name: str
    arguments: dict
    error: str | None = None


def tool_registry(tools: list[Callable]) -> dict[str, Callable]:
    """Tools by name (their `__name__`); fails on a non-callable or two tools with one name."""
    registry: dict[str, Callable] = {}
    for tool in tools:
        name = getattr(tool, "__name__", None)
        if not callable(tool) or not name:
            raise ValueError(f"tools: {tool!r} is not a named function; pass functions (def or async def).")
        if name in registry:
            raise ValueError(f"tools: two tools are named {name!r}; give each tool its own name.")
        registry[name] = tool
    return registry


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a turn, in order."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({err.msg}): {body.strip()!r}"))
            continue
        name = payload.get("name") if isinstance(payload, dict) else None
        arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(
                ToolCall(
                    name if isinstance(name, str) else "",
                    {},
                    'a tool call needs {"name": str, "arguments": object}; got ' + body.strip(),
                )
            )
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def run_tool_calls(calls: list[ToolCall], tools: dict[str, Callable]) -> list[dict]:
    """One tool message per call; failures become "Error: ..." messages instead of exceptions."""
    return [{"role": "tool", "name": call.name, "content": _run(call, tools)} for call in calls]


def _run(call: ToolCall, tools: dict[str, Callable]) -> str:
    if call.error is not None:
        return f"Error: {call.error}"
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; the tools are {sorted(tools)}."
    try:
        inspect.signature(tool).bind(**call.arguments)
    except TypeError as err:
        return f"Error: wrong arguments for {call.name}: {err}."
    except ValueError:  # no signature to check against (a builtin): let the call tell
        pass
    try:
        if inspect.iscoroutinefunction(tool):
            result = asyncio.run(tool(**call.arguments))
        else:
            result = tool(**call.arguments)
    except Exception as err:  # a tool failing on the policy's input is feedback, not a crash
        return f"Error: {call.name} raised {type(err).__name__}: {err}"
    return result if isinstance(result, str) else json.dumps(result, default=str)


def join_turns(turns: list[tuple[list[int], bool]], max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of a multi-turn completion and its loss mask, cut at `max_length` tokens.

    `turns` alternate the model's tokens (flag True) and tool-result tokens (flag False, as
    rendered by the chat template); the mask is 1 on the model's tokens only.
    """
    ids: list[int] = []
    mask: list[int] = []
    for tokens, from_model in turns:
        ids.extend(tokens)
        mask.extend([int(from_model)] * len(tokens))
    return ids[:max_length], mask[:max_length]
