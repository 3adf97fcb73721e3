"""Multi-turn rollouts with tools: generate a turn, run its tool calls, append the results, go on.

One episode per row. Each turn every unfinished episode is generated on (prompt + everything so
far), the turn is read (`tools.TurnParser`: its message and tool calls), the calls run and the
tool messages, rendered as the chat template writes them, are appended. An episode ends when a
turn calls no tool (a turn whose calls cannot be read calls none), when `max_iterations` turns
have had their calls answered (TRL's `max_tool_calling_iterations`: None, no limit; 0, no call is
answered; a call in the turn after that is left unanswered), or when its completion, model and
tool tokens together, reaches `max_completion_length` (then it is truncated, like a single-turn
completion without EOS; tool results that do not fit are cut).

The completion of an episode is every model turn and tool result in order: tool-result tokens are
in the attention mask (the model reads them) and in `Rollout.tool_mask`, which the trainer takes
out of the loss, the KL and the entropy. For the reward functions the completion is the list of
its messages (assistant turns, with `tool_calls` where they called, and tool messages). The
sampler's log-probs are kept per model token (0 on tool results, which are out of the loss); when
a turn of the round has none (a generator that records none, e.g. beam search), the round has none
(`Rollout.sampler_logps` None, as a single-turn rollout without them): no 0, which would read as
probability 1, stands in for them.

Each turn is one generation call over the whole context: the decoder prefills it again rather
than keeping the previous turn's KV cache (prefill is one batched pass; the decoding steps, one
per token, dominate a turn's time). With a collective generator (a vLLM server, sharded weights)
`any_active` keeps a process whose episodes have ended calling it, with no rows, until every
process's episodes have.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from grpo_hf.data.calls import CallThread
from grpo_hf.data.rollout import Rollout, ScoredRound, left_padded, tokenize_prompts
from grpo_hf.episodes.tools import (
    ToolCall,
    ToolResult,
    ToolResultRenderer,
    TurnParser,
    render_tool_prompt,
    run_episode_calls,
)

# (context ids, context mask, max new tokens) -> one turn for every row
GenerateTurn = Callable[[torch.Tensor, torch.Tensor, int], Rollout]


@dataclass
class Episode:
    """One row's episode so far."""

    context: list[int]  # prompt and completion tokens so far
    ids: list[int] = field(default_factory=list)  # completion tokens: model turns and tool results
    from_tool: list[int] = field(default_factory=list)  # 1 on tool-result tokens
    sampler_logps: list[float] | None = field(
        default_factory=list
    )  # 0 on tool results; None: a turn had none
    messages: list[dict] = field(default_factory=list)
    tool_calls: int = 0  # calls answered
    failed_calls: int = 0
    timed_out: bool = False  # a call was abandoned (its thread may still run)
    truncated: bool = False
    done: bool = False

    def add(self, tokens: list[int], logps: list[float] | None, tool: bool) -> None:
        """Append tokens and their sampler log-probs (None: not recorded, for the whole episode)."""
        self.ids += tokens
        self.context += tokens
        self.from_tool += [int(tool)] * len(tokens)
        recorded = self.sampler_logps is not None and logps is not None
        self.sampler_logps = self.sampler_logps + logps if recorded else None


def tool_episodes(
    prompts: list[list[dict]],
    tools: list[dict[str, Callable]],
    schemas: list[list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    generate_turn: GenerateTurn,
    *,
    max_prompt_length: int | None,
    max_iterations: int | None,
    max_completion_length: int,
    timeout: float,
    device: torch.device,
    chat_template_kwargs: dict | None = None,
    pad_to_multiple_of: int | None = None,
    any_active: Callable[[bool], bool] | None = None,
    threads: list[CallThread] | None = None,
) -> tuple[Rollout, list[list[dict]], list[Episode]]:
    """Chat prompts, each with its row's tools (`schemas[i]`) described (`tools.render_tool_prompt`),
    then `run_episodes`. `chat_template_kwargs` go to the chat template for the prompts and the tool
    results; `pad_to_multiple_of` pads the tokenized prompts."""
    texts = [
        render_tool_prompt(tokenizer, p, s, chat_template_kwargs)
        for p, s in zip(prompts, schemas, strict=True)
    ]
    prompt_ids, prompt_mask = tokenize_prompts(
        tokenizer, texts, max_prompt_length, device, pad_to_multiple_of
    )
    return run_episodes(
        prompt_ids,
        prompt_mask,
        generate_turn,
        tokenizer,
        tools,
        schemas=schemas,
        max_iterations=max_iterations,
        max_completion_length=max_completion_length,
        timeout=timeout,
        chat_template_kwargs=chat_template_kwargs,
        any_active=any_active,
        threads=threads,
    )


def run_episodes(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    generate_turn: GenerateTurn,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Callable]],
    *,
    schemas: list[list[dict]] | None = None,
    max_iterations: int | None,
    max_completion_length: int,
    timeout: float,
    chat_template_kwargs: dict | None = None,
    any_active: Callable[[bool], bool] | None = None,
    threads: list[CallThread] | None = None,
) -> tuple[Rollout, list[list[dict]], list[Episode]]:
    """Episodes for (B, P) left-padded prompts; `tools[i]` are row i's tools by name, `schemas[i]`
    their descriptions (for a `response_template` parser to type the arguments), `threads[i]` the
    thread its calls run on (its environment's; None: each call on a thread of its own).

    Returns the rollout (completions right-padded, with `tool_mask`), each episode's messages, and
    the episodes (their tool-call counts). `any_active(this process has episodes going)` says whether
    any process has (for a collective `generate_turn`); None: this process decides alone.
    """
    render, parse = ToolResultRenderer(tokenizer, chat_template_kwargs), TurnParser(tokenizer)
    schemas = schemas or [[] for _ in tools]
    episodes = [Episode(ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    for turn in itertools.count():
        active = [i for i, episode in enumerate(episodes) if not episode.done]
        if not (any_active(bool(active)) if any_active is not None else active):
            break
        budgets = [max_completion_length - len(episodes[i].ids) for i in active]
        ids, mask = left_padded(
            [episodes[i].context for i in active], tokenizer.pad_token_id, prompt_ids.device
        )
        result = generate_turn(ids, mask, max(budgets, default=1))
        calls = []
        for row, (i, budget) in enumerate(zip(active, budgets, strict=True)):
            last = turn == max_iterations
            calls.append(_take_turn(episodes[i], result, row, budget, parse, schemas[i], last))
        turn_threads = None if threads is None else [threads[i] for i in active]
        results = run_episode_calls(calls, [tools[i] for i in active], timeout, turn_threads)
        for i, turn_calls, turn_results in zip(active, calls, results, strict=True):
            if turn_calls:
                _add_tool_results(episodes[i], turn_results, render, max_completion_length)
    return (
        _as_rollout(prompt_ids, prompt_mask, episodes, tokenizer.pad_token_id),
        [e.messages for e in episodes],
        episodes,
    )


def trainer_tool_episodes(
    trainer,
    prompts: list[list[dict]],
    environments: list | None,
    names: list | None,
    generate: GenerateTurn | None = None,
) -> tuple[Rollout, list, list[int]]:
    """`GRPOTrainer`'s multi-turn episodes with each row's tools (of `environments[i]`, named
    `names[i]`): `tool_episodes` with the run's settings, each row's calls on its environment's
    thread; then the environments of abandoned calls are discarded. Returns the rollout, the
    completions and this process's `episode_counts`.
    `generate`: async GRPO's generation thread, sampling this process's rows alone (no lockstep);
    default `trainer.generate_completions`, every process in step."""
    args, accelerator, toolbox = trainer.args, trainer.accelerator, trainer.toolbox
    pool = trainer.environment_pool
    result, messages, episodes = tool_episodes(
        prompts,
        toolbox.for_episodes(environments, len(prompts)),
        [toolbox.schemas[name] for name in names or [None] * len(prompts)],
        trainer.processing_class,
        generate or trainer.generate_completions,
        max_prompt_length=args.max_prompt_length,
        max_iterations=args.max_tool_calling_iterations,
        max_completion_length=args.max_completion_length,
        timeout=args.tool_timeout,
        device=accelerator.device,
        chat_template_kwargs=args.chat_template_kwargs,
        pad_to_multiple_of=args.pad_to_multiple_of,
        any_active=None if generate else trainer.generator.any_active,
        threads=None if environments is None else [pool.thread(e) for e in environments],
    )
    if environments is not None:  # an abandoned call may still be running on its environment
        pool.discard_timed_out(environments, episodes)
    return result, messages, episode_counts(episodes)


def recorded_episodes(trainer, scored: ScoredRound) -> ScoredRound:
    """`scored`, its tool episodes' counts (`ScoredRound.episode_counts`) summed over every process
    and recorded as `tool_metrics` (collective: on the training thread, whichever thread sampled the
    round); recorded once."""
    if scored.episode_counts is not None:
        counts = torch.tensor(scored.episode_counts, device=trainer.accelerator.device)  # (4,)
        trainer.record(tool_metrics(trainer.accelerator.gather(counts).view(-1, 4).sum(dim=0).tolist()))
        scored.episode_counts = None
    return scored


def episode_counts(episodes: list[Episode]) -> list[int]:
    """[episodes, answered calls, failed calls, model turns] of `episodes`, to sum over processes."""
    return [
        len(episodes),
        sum(e.tool_calls for e in episodes),
        sum(e.failed_calls for e in episodes),
        sum(m["role"] == "assistant" for e in episodes for m in e.messages),
    ]


def tool_metrics(counts: list[int]) -> dict[str, float]:
    """A round's tool metrics from `episode_counts` summed over every process: ours per episode, and
    TRL's `tools/call_frequency` (calls per episode) and `tools/failure_frequency` (failed / calls,
    0 without calls)."""
    episodes, calls, failed, turns = counts
    return {
        "tools/calls_per_episode": calls / episodes,
        "tools/failed_calls_per_episode": failed / episodes,
        "tools/turns_per_episode": turns / episodes,
        "tools/call_frequency": calls / episodes,
        "tools/failure_frequency": failed / calls if calls else 0.0,
    }


def _take_turn(
    episode: Episode,
    result: Rollout,
    row: int,
    budget: int,
    parse: TurnParser,
    schemas: list[dict],
    last: bool,
) -> list[ToolCall]:
    """Append row `row` of a generated turn to the episode; return the tool calls to answer."""
    length = int(result.completion_mask[row].sum())
    cut = length > budget
    length = min(length, budget)
    tokens = result.completion_ids[row, :length].tolist()
    logps = None if result.sampler_logps is None else result.sampler_logps[row, :length].tolist()
    message, calls = parse(tokens, episode.context, schemas)
    episode.add(tokens, logps, tool=False)
    episode.messages.append(message)
    if cut or bool(result.truncated[row]):
        episode.truncated = episode.done = True
        return []
    if not calls or last or length == budget:  # nothing to answer, no turn left, or no room left
        episode.done = True
        return []
    return calls


def _add_tool_results(
    episode: Episode, results: list[ToolResult], render: ToolResultRenderer, max_completion_length: int
) -> None:
    """Append the tool messages (cut to the completion budget) and count the calls."""
    episode.tool_calls += len(results)
    episode.failed_calls += sum(r.failed for r in results)
    episode.timed_out |= any(r.timed_out for r in results)
    messages = [r.message for r in results]
    episode.messages += messages
    tokens = render(messages)
    room = max_completion_length - len(episode.ids)
    episode.add(tokens[:room], [0.0] * len(tokens[:room]), tool=True)  # out of the loss
    if len(tokens) >= room:  # no room left for the model to answer
        episode.truncated = episode.done = True


def _as_rollout(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, episodes: list[Episode], pad: int
) -> Rollout:
    width = max(1, max(len(e.ids) for e in episodes))

    def padded(values: list[list], fill, dtype) -> torch.Tensor:
        return torch.tensor(
            [v + [fill] * (width - len(v)) for v in values], dtype=dtype, device=prompt_ids.device
        )

    sampler_logps = None  # a turn without them: none for the round, as no 0 may stand in for them
    if all(e.sampler_logps is not None for e in episodes):
        sampler_logps = padded([e.sampler_logps for e in episodes], 0.0, torch.float32)  # (B, C)
    return Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids=padded([e.ids for e in episodes], pad, torch.long),  # (B, C)
        completion_mask=padded([[1] * len(e.ids) for e in episodes], 0, torch.long),  # (B, C)
        truncated=torch.tensor([e.truncated for e in episodes], device=prompt_ids.device),  # (B,)
        sampler_logps=sampler_logps,
        tool_mask=padded([e.from_tool for e in episodes], 0, torch.long),  # (B, C)
    )
