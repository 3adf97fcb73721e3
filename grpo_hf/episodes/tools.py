"""Tool calling for multi-turn rollouts: describe the tools, parse a turn's calls, run them, render results.

The episode loop that uses these steps is `multi_turn.run_episodes`; environments, whose methods
are tools, are `environments`.

- Description: the tools' JSON schemas come from their signatures and docstrings
  (`transformers.utils.get_json_schema`: type hints and a Google-style "Args:" section) and go to
  the chat template as `tools=`. A template that ignores `tools` (SmolLM2's, for one) renders the
  same text with and without them; then a signature line per tool and the call format are written
  into the system message instead (`tool_system_prompt`), so any chat model can be told about its
  tools. Each row gets the shared tools and its environment's methods; a row with no tool gets its
  prompt as it is.
- Parsing (`TurnParser`): with a `response_template` on the tokenizer (transformers' response
  parsing: a model's tokenizer config may ship one, or set `tokenizer.response_template`),
  `tokenizer.parse_response` reads the turn, so any call format a template describes works.
  Otherwise the format is Hermes (the chat templates of Qwen2.5, Qwen3, Hermes and SmolLM3 use
  it): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn, `arguments`
  also as a JSON string. A chat template that writes calls in another format, with no
  `response_template` to read them, is an error at construction (`check_tool_call_format`).
  A turn with a call that cannot be read (not JSON, no name) is plain text with no call, so the
  episode ends there, as in TRL and in vLLM's tool parsers at inference: a malformed call is no
  call. A turn with calls becomes `{"role": "assistant", "content": <text outside the calls>,
  "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}` (transformers' shape).
- Running: every call against the given functions (plain or `async def`), with a timeout, on the
  episode's environment's own thread (`data.calls.CallThread`, where its reset and get_reward run
  too) or, without an environment, on a thread of its own. An unknown tool, arguments that do not
  fit, a raising tool or a timeout give the tool message `{"error": "..."}` and count as a failed
  call, so one bad call never stops training. Calls of one episode run in order (an environment's
  state may depend on it), episodes run concurrently. A call that times out is abandoned, not
  killed: it runs on in the background (Python cannot stop a thread), and its environment's later
  calls wait for it, each within its own time limit. A result is sent as is when it is a str, else as JSON.
- Rendering: tool messages become the tokens the chat template puts between the model's turn
  and the next assistant turn (`ToolResultRenderer`), found by rendering a conversation with and
  without them, so every template that renders `tool` messages works without per-model code.
"""

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from grpo_hf.data.calls import CallThread, CallTimeout, call_with_timeout
from grpo_hf.data.tool_results import tool_error

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: the tool's name and arguments, or why the call cannot be made."""

    name: str
    arguments: object
    error: str | None = None


@dataclass
class ToolResult:
    """The tool message answering one call, and whether the call failed or timed out."""

    message: dict
    failed: bool = False
    timed_out: bool = False


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
    """The tools of a run: the shared functions (`tools=`) and, per environment name, that
    environment's methods, read from one instance of it (`EnvironmentPool.probes`).

    Checked once, before any model work: every tool has a name and a schema, and no environment
    method shares a name with a shared tool. `schemas[name]` describes the tools of a row of
    environment `name` (None: no environment, or a single factory); `tools` is every tool of the run.
    """

    def __init__(self, tools: list[Callable] | None, environments: dict[str | None, object] | None = None):
        self.shared = tool_registry(tools or [])
        own = {
            name: tool_registry(environment_tools(env)) if env is not None else {}
            for name, env in (environments or {None: None}).items()
        }
        for registry in own.values():
            clash = sorted(self.shared.keys() & registry.keys())
            if clash:
                raise ValueError(
                    f"tools: {clash} are both in tools= and methods of an environment; rename one."
                )
        self.schemas = {name: tool_schemas({**self.shared, **registry}) for name, registry in own.items()}
        self.tools = [
            *self.shared.values(),
            *(tool for registry in own.values() for tool in registry.values()),
        ]

    def for_episodes(self, environments: list[object] | None, rows: int) -> list[dict[str, Callable]]:
        """Each episode's tools by name: the shared ones and its environment's bound methods."""
        if environments is None:
            return [self.shared] * rows
        return [{**self.shared, **tool_registry(environment_tools(e))} for e in environments]


def environment_tools(environment: object) -> list[Callable]:
    """An environment's tools: its public methods (bound), `reset` and `get_reward` excepted."""
    names = [n for n in dir(type(environment)) if not n.startswith("_") and n not in ("reset", "get_reward")]
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
    if not schemas:
        return plain
    with_tools = tokenizer.apply_chat_template(prompt, tools=schemas, **kwargs)
    if with_tools != plain:
        return with_tools
    description = tool_system_prompt(schemas)
    if prompt and prompt[0]["role"] == "system":
        prompt = [{"role": "system", "content": f"{prompt[0]['content']}\n\n{description}"}, *prompt[1:]]
    else:
        prompt = [{"role": "system", "content": description}, *prompt]
    return tokenizer.apply_chat_template(prompt, **kwargs)


def check_tool_call_format(tokenizer: PreTrainedTokenizerBase) -> None:
    """Fail when the chat template writes tool calls in a format other than Hermes and the tokenizer
    has no `response_template` to read them (the calls the model writes would never be seen)."""
    if getattr(tokenizer, "response_template", None) is not None:
        return
    call = {"type": "function", "function": {"name": "probe_tool_7f3a", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, TypeError):  # the template cannot write calls: the system prompt teaches Hermes
        return
    if "probe_tool_7f3a" in text and "<tool_call>" not in text:
        raise ValueError(
            "The chat template writes tool calls in a format other than Hermes <tool_call>{...}</tool_call>, and the "
            "tokenizer has no response_template to parse them. Set tokenizer.response_template (transformers' "
            "response parsing, see its chat_response_parsing docs) for this model's format and pass the tokenizer "
            "as processing_class."
        )


class TurnParser:
    """A model turn -> its assistant message and its tool calls (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.templated = getattr(tokenizer, "response_template", None) is not None

    def __call__(
        self, tokens: list[int], context: list[int], schemas: list[dict]
    ) -> tuple[dict, list[ToolCall]]:
        """The turn's message and calls; `context` is what preceded the turn, `schemas` the row's tools."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.templated:
            try:
                parsed = self.tokenizer.parse_response(tokens, prefix=context, tools=schemas or None)
                if not isinstance(parsed, dict):  # a turn cut so short that nothing was read
                    raise ValueError("parse_response read no message")
                calls = _calls_of(parsed.pop("tool_calls", None) or [])
            except (ValueError, TypeError):  # a call it cannot read: the turn is text
                return {"role": "assistant", "content": text}, []
            content = parsed.get("content") or ""
            eos = self.tokenizer.eos_token
            message = {**parsed, "content": content.removesuffix(eos) if eos else content}
        else:
            calls = parse_tool_calls(text)
            message = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip() if calls else text}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return message, calls


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a turn, in order;
    none if any of them cannot be read (not a JSON object, no name)."""
    payloads = []
    for body in TOOL_CALL.findall(text):
        try:
            payloads.append(json.loads(body))
        except json.JSONDecodeError:
            return []
    try:
        return _calls_of(payloads)
    except ValueError:
        return []


def _calls_of(payloads: list) -> list[ToolCall]:
    """Calls from `{"name", "arguments"}` objects (or `{"type", "function": {...}}`); ValueError
    when one has no name. Missing arguments are {}; arguments that are not an object (after
    decoding a JSON string) make a call that fails, as does a type other than "function"."""
    calls = []
    for payload in payloads:
        function = payload.get("function", payload) if isinstance(payload, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"a tool call needs a name: {payload!r}")
        arguments = function.get("arguments")
        arguments = {} if arguments is None else arguments
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        error = None
        if payload.get("type", "function") != "function":
            error = f"unsupported tool call type {payload['type']!r}"
        elif not isinstance(arguments, dict):
            error = f"the arguments of {function['name']} must be a JSON object, got {arguments!r}"
        calls.append(ToolCall(function["name"], arguments, error))
    return calls


def run_tool_calls(
    calls: list[ToolCall], tools: dict[str, Callable], timeout: float, thread: CallThread | None = None
) -> list[ToolResult]:
    """One tool message per call, in order; failures become `{"error": ...}` messages, not exceptions.
    Each call runs on `thread` (an environment's own) or, without one, on a thread of its own."""
    return [_run_with_timeout(call, tools, timeout, thread) for call in calls]


def run_episode_calls(
    calls: list[list[ToolCall]],
    tools: list[dict[str, Callable]],
    timeout: float,
    threads: list[CallThread] | None = None,
) -> list[list[ToolResult]]:
    """`run_tool_calls` for several episodes at once: episodes concurrently, each one's calls in order
    (on `threads[i]`, episode i's environment's thread, when given)."""
    busy = [i for i, episode in enumerate(calls) if episode]
    results: list[list[ToolResult]] = [[] for _ in calls]
    if not busy:
        return results
    threads = threads or [None] * len(calls)
    with ThreadPoolExecutor(max_workers=min(len(busy), 64)) as pool:
        futures = {i: pool.submit(run_tool_calls, calls[i], tools[i], timeout, threads[i]) for i in busy}
        for i, future in futures.items():
            results[i] = future.result()
    return results


def _run_with_timeout(
    call: ToolCall, tools: dict[str, Callable], timeout: float, thread: CallThread | None
) -> ToolResult:
    """`_run` on `thread` (or a thread of its own), abandoned after `timeout` seconds (then a failed,
    timed-out call)."""
    run = call_with_timeout if thread is None else thread.call
    try:
        content, failed = run(lambda: _run(call, tools), timeout, call.name)
    except CallTimeout as err:
        return ToolResult(_tool_message(call, tool_error(f"{err}.")), True, True)
    return ToolResult(_tool_message(call, content), failed)


def _tool_message(call: ToolCall, content: str) -> dict:
    return {"role": "tool", "name": call.name, "content": content}


def _run(call: ToolCall, tools: dict[str, Callable]) -> tuple[str, bool]:
    """The call's result as text, and whether it failed."""
    if call.error is not None:
        return tool_error(call.error), True
    tool = tools.get(call.name)
    if tool is None:
        return tool_error(f"unknown tool {call.name!r}; the tools are {sorted(tools)}."), True
    try:
        inspect.signature(tool).bind(**call.arguments)
    except TypeError as err:
        return tool_error(f"wrong arguments for {call.name}: {err}."), True
    except ValueError:  # no signature to check against (a builtin): let the call tell
        pass
    try:
        if inspect.iscoroutinefunction(tool):
            result = asyncio.run(tool(**call.arguments))
        else:
            result = tool(**call.arguments)
    except Exception as err:  # a tool failing on the policy's input is feedback, not a crash
        return tool_error(f"{call.name} raised {type(err).__name__}: {err}"), True
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False


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
