"""Multi-turn episodes with tools, on scripted model turns: layout, masks, turn limits, budgets, the trainer."""

import re
from dataclasses import replace

import pytest
import torch
from datasets import Dataset
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import make_config

from grpo_hf import GRPOTrainer
from grpo_hf.data.batches import round_batch
from grpo_hf.data.rollout import Rollout, completion_mask_after_eos
from grpo_hf.episodes.multi_turn import run_episodes, tool_episodes
from grpo_hf.episodes.tools import tool_registry
from grpo_hf.rewards import accuracy_reward

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ADD_2_3 = {"name": "add", "arguments": {"a": 2, "b": 3}}
TOOL_5 = (
    "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"  # a tool message, as the template writes it
)


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def ids_of(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class Script:
    """Model turns by row tag ("row0" in the prompt) and turn number (tool messages so far).

    A turn text ending in "..." has no EOS (the model ran on); others end with EOS. The first
    `scored_calls` generation calls record sampler log-probs (-0.5 each), later ones none (None: all).
    """

    def __init__(self, turns: dict[str, list[str]], scored_calls: int | None = None):
        self.turns, self.scored_calls = turns, scored_calls
        self.calls = []  # (rows, max_new_tokens) of each generation call

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> Rollout:
        rows = []
        for context, m in zip(ids, mask, strict=True):
            text = TOKENIZER.decode(context[m.bool()])
            tag = re.search(r"row\d", text).group(0)
            text_turn = self.turns[tag][text.count("<|im_start|>tool")]
            tokens = ids_of(text_turn.removesuffix("...")) + ([] if text_turn.endswith("...") else [EOS])
            tokens = tokens[:max_new_tokens]
            rows.append(tokens + [TOKENIZER.pad_token_id] * (max_new_tokens - len(tokens)))
        self.calls.append((len(rows), max_new_tokens))
        completion_ids = torch.tensor(rows, device=ids.device)  # (B, C)
        completion_mask, truncated = completion_mask_after_eos(completion_ids, [EOS])
        logps = torch.full(completion_ids.shape, -0.5, device=ids.device) * completion_mask  # (B, C)
        if self.scored_calls is not None and len(self.calls) > self.scored_calls:
            logps = None
        return Rollout(ids, mask, completion_ids, completion_mask, truncated, logps)


def episodes(
    turns: dict[str, list[str]],
    max_completion_length: int = 256,
    max_iterations: int | None = 2,
    scored_calls: int | None = None,
):
    prompts = [[{"role": "user", "content": f"{tag}: 2 + 3?"}] for tag in turns]
    script = Script(turns, scored_calls)
    result, messages, eps = tool_episodes(
        prompts,
        [tool_registry([add])] * len(prompts),
        [[]] * len(prompts),
        TOKENIZER,
        script,
        max_prompt_length=None,
        max_iterations=max_iterations,
        max_completion_length=max_completion_length,
        timeout=5.0,
        device=torch.device("cpu"),
    )
    return result, messages, eps, script


def test_a_tool_call_gets_its_result_and_the_model_answers_after_it():
    result, messages, eps, script = episodes({"row0": [CALL, "5"], "row1": ["7"]})
    call_turn, answer = ids_of(CALL) + [EOS], ids_of("5") + [EOS]
    tool = ids_of(TOOL_5)
    row0 = call_turn + tool + answer
    assert result.completion_ids[0, : len(row0)].tolist() == row0
    assert result.completion_mask[0].tolist() == [1] * len(row0)  # the model reads the tool result
    assert result.tool_mask[0].tolist() == [0] * len(call_turn) + [1] * len(tool) + [0] * len(answer)
    assert result.sampler_logps[0].tolist() == [-0.5] * len(call_turn) + [0.0] * len(tool) + [-0.5] * len(
        answer
    )
    assert result.completion_mask[1].tolist() == [1, 1] + [0] * (len(row0) - 2)  # "7" + EOS
    assert result.tool_mask[1].sum() == 0
    assert not result.truncated.any()
    assert messages[0] == [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": ADD_2_3}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    assert messages[1] == [{"role": "assistant", "content": "7"}]
    assert [(e.tool_calls, e.failed_calls) for e in eps] == [(1, 0), (0, 0)]
    # Turn 2 generates for the unfinished episode only, within what is left of its budget.
    assert script.calls == [(2, 256), (1, 256 - len(call_turn) - len(tool))]
    assert accuracy_reward(completions=messages, answer=["5", "5"]) == [1.0, 0.0]


def test_a_malformed_call_ends_the_episode_as_plain_text():
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    result, messages, eps, script = episodes({"row0": [broken, "5"]})
    assert messages[0] == [{"role": "assistant", "content": broken}]
    assert (eps[0].tool_calls, eps[0].failed_calls) == (0, 0)  # no call was made
    assert len(script.calls) == 1 and not result.truncated[0]


def test_a_call_of_an_unknown_tool_is_answered_with_an_error_and_counted_as_failed():
    nope = '<tool_call>{"name": "sub", "arguments": {"a": 2}}</tool_call>'
    _, messages, eps, _ = episodes({"row0": [nope, "5"]})
    assert messages[0][1]["content"] == "{\"error\": \"unknown tool 'sub'; the tools are ['add'].\"}"
    assert (eps[0].tool_calls, eps[0].failed_calls) == (1, 1)
    assert messages[0][-1] == {"role": "assistant", "content": "5"}


@pytest.mark.parametrize(("max_iterations", "answered"), [(0, 0), (2, 2)])
def test_calls_past_max_iterations_are_left_unanswered(max_iterations, answered):
    result, messages, eps, script = episodes({"row0": [CALL, CALL, CALL, "5"]}, max_iterations=max_iterations)
    assert [m["role"] for m in messages[0]] == ["assistant", "tool"] * answered + ["assistant"]
    assert "tool_calls" in messages[0][-1]  # the last turn called, unanswered
    assert eps[0].tool_calls == answered and not result.truncated[0]  # answered calls count, as in TRL
    assert len(script.calls) == answered + 1


def test_a_turn_without_eos_truncates_the_episode():
    result, messages, _, _ = episodes({"row0": ["and so on..."]}, max_completion_length=8)
    assert result.truncated.tolist() == [True]
    assert result.completion_ids[0].tolist() == ids_of("and so o")
    assert messages[0] == [{"role": "assistant", "content": "and so o"}]


def test_tool_results_are_cut_at_the_completion_budget_and_the_episode_truncated():
    budget = len(ids_of(CALL)) + 1 + 5  # the call turn, then 5 tokens of the tool result
    result, messages, _, script = episodes({"row0": [CALL, "5"]}, max_completion_length=budget)
    assert result.completion_ids[0].tolist() == ids_of(CALL) + [EOS] + ids_of(TOOL_5)[:5]
    assert result.tool_mask[0].tolist() == [0] * (budget - 5) + [1] * 5
    assert result.truncated.tolist() == [True]
    assert len(script.calls) == 1  # no room for a second turn
    assert [m["role"] for m in messages[0]] == ["assistant", "tool"]
    assert accuracy_reward(completions=messages, answer=["5"]) == [0.0]  # the tool's "5" is not an answer


def test_run_episodes_takes_the_prompt_tokens_as_given():
    ids, mask = torch.tensor([[0, 0, 5, 6]]), torch.tensor([[0, 0, 1, 1]])
    seen = []

    def generate_turn(context_ids, context_mask, max_new_tokens):
        seen.append(context_ids[context_mask.bool()].tolist())
        completion = torch.tensor([[EOS]])
        return Rollout(
            context_ids, context_mask, completion, torch.ones_like(completion), torch.tensor([False])
        )

    result, _, _ = run_episodes(
        ids, mask, generate_turn, TOKENIZER, [{}], max_iterations=None, max_completion_length=4, timeout=1.0
    )
    assert seen == [[5, 6]]
    assert result.completion_ids.tolist() == [[EOS]] and result.sampler_logps is None  # none recorded


def test_episodes_without_sampler_logps_have_none_not_zeros():
    # The generator recorded none: a 0 would read as probability 1 in the sampler metrics and weights.
    def generate_turn(ids, mask, max_new_tokens):
        completion = torch.tensor([[40, 41, EOS]])  # (1, 3)
        return Rollout(ids, mask, completion, torch.ones_like(completion), torch.tensor([False]), None)

    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    result, _, _ = run_episodes(
        ids, mask, generate_turn, TOKENIZER, [{}], max_iterations=None, max_completion_length=16, timeout=1.0
    )
    assert result.sampler_logps is None
    assert "sampler_logps" not in round_batch(result, torch.zeros(1), False)
    # Recorded on the first turn only: row1's episode has them, row0's second turn has none, so the
    # round has none (no row keeps a 0 in place of a log-prob).
    result, _, _, script = episodes({"row0": [CALL, "5"], "row1": ["7"]}, scored_calls=1)
    assert len(script.calls) == 2 and result.sampler_logps is None
    result, _, _, _ = episodes({"row0": [CALL, "5"], "row1": ["7"]}, scored_calls=2)  # both turns scored
    assert result.sampler_logps[1, :2].tolist() == [-0.5, -0.5]


# ---- Through the trainer ------------------------------------------------------------------------


class Ledger:
    """An environment whose state the reward reads: the sum of what `deposit` was given."""

    def reset(self, start: int, **kwargs) -> None:
        self.balance = start

    def deposit(self, amount: int) -> int:
        """Adds to the balance.

        Args:
            amount: How much.
        """
        self.balance += amount
        return self.balance


def balance_reward(completions, environments, **kwargs) -> list[float]:
    return [float(e.balance) for e in environments]


class ScriptedTrainer(GRPOTrainer):
    """Turn 1 deposits 10 x the row's number, turn 2 says "done"."""

    def generate_completions(self, prompt_ids, prompt_mask, max_new_tokens=None):
        turns = {}
        for context, m in zip(prompt_ids, prompt_mask, strict=True):
            tag = re.search(r"row\d", TOKENIZER.decode(context[m.bool()])).group(0)
            amount = int(tag[-1]) * 10
            turns.setdefault(
                tag,
                [
                    f'<tool_call>{{"name": "deposit", "arguments": {{"amount": {amount}}}}}</tool_call>',
                    "done",
                ],
            )
        return Script(turns)(prompt_ids, prompt_mask, max_new_tokens or self.args.max_completion_length)


def test_trainer_runs_episodes_hands_environments_to_rewards_and_masks_tool_tokens(tmp_path):
    prompts = [[{"role": "user", "content": f"row{i}: deposit"}] for i in range(2)]
    dataset = Dataset.from_dict({"prompt": prompts, "start": [100, 200]})
    trainer = ScriptedTrainer(
        model=tiny_llama(),
        reward_funcs=balance_reward,
        args=make_config(tmp_path, max_steps=1, max_completion_length=128, logging_steps=1, beta=0.0),
        train_dataset=dataset,
        processing_class=TOKENIZER,
        environment_factory=Ledger,
    )
    scored = trainer._sample_and_score([dataset[0], dataset[0], dataset[1], dataset[1]])
    assert scored.rewards_per_func[:, 0].tolist() == [
        100.0,
        100.0,
        210.0,
        210.0,
    ]  # start + deposit, per episode
    result = scored.result
    tool_tokens = ids_of("\n<|im_start|>tool\n100<|im_end|>\n<|im_start|>assistant\n")
    assert result.tool_mask[0].sum() == len(tool_tokens)
    batch = trainer._generate_and_score([dataset[0]] * 4 + [dataset[1]] * 4)[0]
    model_tokens = (result.completion_mask - result.tool_mask)[0].sum()
    assert batch["completion_mask"].sum(dim=1).tolist()[:1] == [
        model_tokens
    ]  # the loss sees the model's tokens
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/calls_per_episode"] == 1.0 and logged["tools/failed_calls_per_episode"] == 0.0
    assert logged["tools/turns_per_episode"] == 2.0
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0
    assert "sampler/ratio_mean" in logged  # the script records sampler log-probs
    # Lengths count the model's tokens only (as TRL): the call turn and "done", each with EOS; row1's
    # call says 10 where row0's says 0 (one byte more); 4 episodes of each.
    row0 = len(ids_of('<tool_call>{"name": "deposit", "arguments": {"amount": 0}}</tool_call>')) + 1 + 5
    assert logged["completions/mean_length"] == row0 + 0.5
    assert logged["completions/max_length"] == row0 + 1


class UnscoredTrainer(ScriptedTrainer):
    """ScriptedTrainer's turns without sampler log-probs (a generator that records none)."""

    def generate_completions(self, prompt_ids, prompt_mask, max_new_tokens=None):
        return replace(
            super().generate_completions(prompt_ids, prompt_mask, max_new_tokens), sampler_logps=None
        )


def test_episodes_without_sampler_logps_log_no_sampler_metrics(tmp_path):
    prompts = [[{"role": "user", "content": f"row{i}: deposit"}] for i in range(2)]
    dataset = Dataset.from_dict({"prompt": prompts, "start": [100, 200]})
    args = make_config(
        tmp_path, max_steps=1, max_completion_length=128, logging_steps=1, beta=0.0, sampler_is_cap=2.0
    )
    trainer = UnscoredTrainer(
        tiny_llama(), balance_reward, args, dataset, processing_class=TOKENIZER, environment_factory=Ledger
    )
    [batch] = trainer._generate_and_score([dataset[0]] * 4 + [dataset[1]] * 4)
    assert "sampler_logps" not in batch  # no importance weights against a made-up sampler
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/calls_per_episode"] == 1.0
    assert not [k for k in logged if k.startswith(("sampler/", "sampling/"))]


def test_trainer_with_tools_trains_on_a_real_decoder(tmp_path):
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i} + {i}?"}] for i in range(4)]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [
            float(len(c)) + len(c[-1]["content"]) / 10 for c in completions
        ],
        args=make_config(tmp_path, max_steps=1, max_tool_calling_iterations=1),
        train_dataset=dataset,
        processing_class=TOKENIZER,
        tools=[add],
    )
    trainer.train()
    assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, model.parameters(), strict=True))


def test_tools_need_chat_prompts_and_a_free_environments_column(tmp_path):
    args = make_config(tmp_path)
    with pytest.raises(ValueError, match="tools and environments need chat prompts"):
        GRPOTrainer(
            tiny_llama(),
            balance_reward,
            args,
            Dataset.from_dict({"prompt": ["hi"]}),
            processing_class=TOKENIZER,
            tools=[add],
        )
    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]], "environments": [1]})
    with pytest.raises(ValueError, match="column named 'environments'"):
        GRPOTrainer(
            tiny_llama(), balance_reward, args, chat, processing_class=TOKENIZER, environment_factory=Ledger
        )


def test_dynamic_sampling_keeps_the_tool_mask_of_the_rows_it_keeps(tmp_path):
    # Every group's episodes score alike, so each extra round is dropped too and the batch is filled
    # from stacked rounds: the tool mask must follow the rows through stacking and selection.
    prompts = [[{"role": "user", "content": f"row{i}: deposit"}] for i in range(2)]
    dataset = Dataset.from_dict({"prompt": prompts, "start": [100, 200]})
    args = make_config(
        tmp_path, max_completion_length=128, beta=0.0, dynamic_sampling=True, max_dynamic_sampling_rounds=2
    )
    trainer = ScriptedTrainer(
        tiny_llama(), balance_reward, args, dataset, processing_class=TOKENIZER, environment_factory=Ledger
    )
    trainer.model.train()
    [batch] = trainer._generate_and_score([dataset[0]] * 4 + [dataset[1]] * 4)
    single = trainer._sample_and_score([dataset[0]]).result
    model_tokens = int((single.completion_mask - single.tool_mask).sum())
    assert batch["completion_mask"].sum(dim=1).tolist()[0] == model_tokens
    assert trainer.metrics.values["train"]["dynamic_sampling/extra_rounds"] == [2.0]
