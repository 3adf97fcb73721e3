"""Tool calling for multi-turn rollouts: describe the tools, parse a turn's calls, run them, render results.

The episode loop that uses these steps is `multi_turn.run_episodes`; this module is its pure parts.

- Format: Hermes (the chat templates of Qwen2.5, Qwen3, Hermes and SmolLM3 use it): a call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's text, several per
  turn allowed. `arguments` may also be a JSON string (some templates write it so). A malformed
  call becomes a `ToolCall` carrying the error, not an exception: a policy in training writes
  malformed calls and is better told so in the tool message than stopped.
- Description: the tools' JSON schemas come from their signatures and docstrings
  (`transformers.utils.get_json_schema`: type hints and a Google-style "Args:" section) and go to
  the chat template as `tools=`. A template that ignores `tools` (SmolLM2's, for one) renders the
  same text with and without them; then a signature line per tool and the call format are written
  into the system message instead (`tool_system_prompt`), so any chat model can be told about its
  tools.
- Running: every call against the given functions (plain or `async def`), each in its own thread
  with a timeout; an unknown tool, bad arguments, a raising tool or a timeout give an
  "Error: ..." message, so one bad call never stops training. Calls of one episode run in order
  (an environment's state may depend on it), episodes run concurrently. A call that times out is
  abandoned, not killed: its thread runs on in the background (Python cannot stop a thread).
- Rendering: tool messages become the tokens the chat template puts between the model's turn
  and the next assistant turn (`ToolResultRenderer`), found by rendering a conversation with and
  without them, so every template that renders `tool` messages works without per-model code.
"""

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

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


class Toolbox:
    """The tools of a run: shared functions (`tools=`) and, per episode, the methods of a fresh
    environment (`environment_factory=`), whose `reset(**dataset_columns)`, if it has one, is called
    with the episode's dataset row before the episode starts.

    Checked once, before any model work: every tool has a name and a schema, no two share a name.
    One environment is made for that; every environment the factory makes must have the same
    methods, since the prompt describes the tools once.
    """

    def __init__(self, tools: list[Callable] | None, environment_factory: Callable[[], object] | None):
        self.shared = tool_registry(tools or [])
        self.environment_factory = environment_factory
        own = environment_tools(environment_factory()) if environment_factory is not None else []
        clash = sorted(self.shared.keys() & {t.__name__ for t in own})
        if clash:
            raise ValueError(f"tools: {clash} are both in tools= and methods of the environment; rename one.")
        every = {**self.shared, **tool_registry(own)}
        if not every:
            raise ValueError(
                "tools / environment_factory give no tool; pass functions or an environment with methods."
            )
        self.schemas = tool_schemas(every)

    def for_episodes(self, rows: list[dict]) -> tuple[list[dict[str, Callable]], list[object] | None]:
        """Each episode's tools by name, and its environment (None without an environment_factory)."""
        if self.environment_factory is None:
            return [self.shared] * len(rows), None
        environments = []
        for row in rows:
            environment = self.environment_factory()
            if callable(getattr(environment, "reset", None)):
                environment.reset(**{k: v for k, v in row.items() if k != "prompt"})
            environments.append(environment)
        tools = [{**self.shared, **tool_registry(environment_tools(e))} for e in environments]
        return tools, environments


def environment_tools(environment: object) -> list[Callable]:
    """An environment's tools: its public methods (bound), `reset` excepted."""
    names = [n for n in dir(type(environment)) if not n.startswith("_") and n != "reset"]
    return [getattr(environment, n) for n in names if inspect.isfunction(getattr(type(environment), n))]


def tool_schemas(tools: dict[str, Callable]) -> list[dict]:
    """The JSON schema of every tool, as chat templates take them; an error names a tool that has none."""
    schemas = []
    for name, tool in tools.items():
        try:
            schemas.append(get_json_schema(tool))
        except Exception as err:
            raise ValueError(
                f"tools: cannot describe {name!r} to the model ({err}). Give it type hints and a docstring "
                'with an "Args:" section naming each argument.'
            ) from err
    return schemas


def tool_system_prompt(schemas: list[dict]) -> str:
    """The tools, one signature line each, and the Hermes call format, for chat templates that do
    not render `tools` themselves (models not trained on tool use: a short signature reads more
    plainly to them than the JSON schemas tool-trained templates print)."""
    lines = []
    for schema in schemas:
        function = schema["function"]
        properties = function.get("parameters", {}).get("properties", {})
        arguments = ", ".join(f"{name}: {spec.get('type', 'any')}" for name, spec in properties.items())
        lines.append(f"- {function['name']}({arguments}): {function.get('description', '')}")
    return (
        "You can call these tools:\n" + "\n".join(lines) + "\n"
        'To call a tool, write <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}'
        "</tool_call>. Its result comes back in the next message."
    )


def render_tool_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict],
    schemas: list[dict],
    chat_template_kwargs: dict | None = None,
) -> str:
    """A chat prompt with its tools described: by the chat template, or in the system message.
    `chat_template_kwargs` go to every `apply_chat_template` call."""
    kwargs = dict(tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
    plain = tokenizer.apply_chat_template(prompt, **kwargs)
    with_tools = tokenizer.apply_chat_template(prompt, tools=schemas, **kwargs)
    if with_tools != plain:
        return with_tools
    description = tool_system_prompt(schemas)
    if prompt and prompt[0]["role"] == "system":
        prompt = [{"role": "system", "content": f"{prompt[0]['content']}\n\n{description}"}, *prompt[1:]]
    else:
        prompt = [{"role": "system", "content": description}, *prompt]
    return tokenizer.apply_chat_template(prompt, **kwargs)


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


def run_tool_calls(calls: list[ToolCall], tools: dict[str, Callable], timeout: float) -> list[dict]:
    """One tool message per call, in order; failures become "Error: ..." messages instead of exceptions."""
    return [
        {"role": "tool", "name": call.name, "content": _run_with_timeout(call, tools, timeout)}
        for call in calls
    ]


def is_tool_error(message: dict) -> bool:
    """Whether a tool message reports a failed call (the "Error: ..." messages of `run_tool_calls`)."""
    return str(message.get("content")).startswith("Error: ")


def run_episode_calls(
    calls: list[list[ToolCall]], tools: list[dict[str, Callable]], timeout: float
) -> list[list[dict]]:
    """`run_tool_calls` for several episodes at once: episodes concurrently, each one's calls in order."""
    busy = [i for i, episode in enumerate(calls) if episode]
    results: list[list[dict]] = [[] for _ in calls]
    if not busy:
        return results
    with ThreadPoolExecutor(max_workers=min(len(busy), 64)) as pool:
        futures = {i: pool.submit(run_tool_calls, calls[i], tools[i], timeout) for i in busy}
        for i, future in futures.items():
            results[i] = future.result()
    return results


def _run_with_timeout(call: ToolCall, tools: dict[str, Callable], timeout: float) -> str:
    """`_run` in a daemon thread, abandoned after `timeout` seconds."""
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(_run(call, tools)), daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        return f"Error: {call.name} did not return within {timeout:g} s."
    return outcome[0]


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


class ToolResultRenderer:
    """Tool messages -> the token ids that follow a model turn ending in EOS, up to the next
    assistant turn's header, as the chat template writes them.

    Found once per renderer by rendering a stand-in conversation: its text without the tool
    messages is a prefix of its text with them (and the next generation prompt); the rest is what
    the tool messages add. What the template writes after an assistant message's content (e.g.
    "<|im_end|>\\n") is generated by the model up to its EOS; the remainder (the "\\n") comes first.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict | None = None):
        self.tokenizer, self.chat_template_kwargs = tokenizer, chat_template_kwargs or {}
        self._head = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
        self._base = tokenizer.apply_chat_template(self._head, tokenize=False, **self.chat_template_kwargs)
        tail = self._base[self._base.rindex("A") + 1 :]  # what follows an assistant turn's content
        eos = tokenizer.eos_token or ""
        self._gap = tail[len(eos) :] if eos and tail.startswith(eos) else tail

    def __call__(self, messages: list[dict]) -> list[int]:
        full = self.tokenizer.apply_chat_template(
            self._head + messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        if not full.startswith(self._base):
            raise ValueError(
                "The chat template renders an assistant turn differently when tool messages follow it, so tool "
                "results cannot be appended to a rollout; use a chat template that renders 'tool' messages."
            )
        text = self._gap + full[len(self._base) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
