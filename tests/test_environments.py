"""Environments (TRL's `environment_factory`): a dict of them routed by the `environment` column, each
row's prompt with only its environment's tools, the instance pool, environments that own the data
(`reset()` returns the prompt) or the reward (`get_reward`), `trainer.environments`, the errors."""

import asyncio
import json
import sqlite3
import threading
import time

import pytest
import torch
from datasets import Dataset
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.algorithm.advantages import batch_advantages
from grpo_hf.data.rollout import Rollout, completion_mask_after_eos
from grpo_hf.episodes.environments import (
    EMPTY_PROMPT,
    EnvironmentPool,
    check_reward_source,
    train_dataset_or_placeholder,
)
from grpo_hf.episodes.multi_turn import recorded_episodes

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


class CounterEnv:
    """Owns its reward: the counter."""

    made = 0

    def __init__(self):
        CounterEnv.made += 1
        self.counter = 0

    def reset(self, **kwargs) -> str:
        self.seen, self.counter = kwargs, 0
        return "Count."

    def increment(self, step: int) -> int:
        """Adds to the counter.

        Args:
            step: How much.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)


class EchoEnv:
    """No reward of its own."""

    def reset(self, **kwargs) -> str:
        self.seen, self.said = kwargs, ""
        return "Echo."

    def shout(self, text: str) -> str:
        """Shouts.

        Args:
            text: What to shout.
        """
        self.said = text.upper()
        return self.said


class ScriptedTrainer(GRPOTrainer):
    """Turn texts from `script(context, i)`: the decoded context (prompt and turns so far) of row i
    of the generation call; every turn ends with EOS. `contexts` records each call's contexts."""

    def generate_completions(self, prompt_ids, prompt_mask, max_new_tokens=None):
        width = max_new_tokens or self.args.max_completion_length
        contexts = [
            TOKENIZER.decode(ids[mask.bool()]) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)
        ]
        self.contexts = [*getattr(self, "contexts", []), contexts]
        rows = []
        for i, context in enumerate(contexts):
            tokens = (TOKENIZER(self.script(context, i), add_special_tokens=False)["input_ids"] + [EOS])[
                :width
            ]
            rows.append(tokens + [TOKENIZER.pad_token_id] * (width - len(tokens)))
        completion_ids = torch.tensor(rows, device=prompt_ids.device)  # (B, C)
        mask, truncated = completion_mask_after_eos(completion_ids, [EOS])
        return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def answered(context: str) -> bool:
    """Whether a tool result is in the context (the turn after a call)."""
    return "<|im_start|>tool" in context


def mixed_script(context: str, i: int) -> str:
    """First turn by row: a call of its own tool, no call, its own tool, another environment's tool."""
    if answered(context):
        return "Done!"
    return [call("increment", step=1), "I won't", call("shout", text="hi"), call("increment", step=2)][i % 4]


def trainer_for(tmp_path, cls=ScriptedTrainer, **kwargs) -> GRPOTrainer:
    settings = dict(max_steps=1, max_completion_length=256, beta=0.0, logging_steps=1)
    args = make_config(tmp_path, **{**settings, **kwargs.pop("args", {})})
    return cls(tiny_llama(), args=args, processing_class=TOKENIZER, **kwargs)


# ---- Through the trainer ------------------------------------------------------------------------


def test_a_dict_of_environments_routes_rows_and_describes_only_their_tools(tmp_path):
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 2})  # no prompt: reset() gives it
    trainer = trainer_for(
        tmp_path,
        args=dict(per_device_train_batch_size=4, num_generations=2),
        reward_funcs=length_reward,
        train_dataset=dataset,
        environment_factory={"counter": CounterEnv, "echo": EchoEnv},
    )
    trainer.script = mixed_script
    assert [t.__name__ for t in trainer.tools] == ["increment", "shout"]
    rows = [{"environment": "counter"}] * 2 + [{"environment": "echo"}] * 2
    scored = recorded_episodes(trainer, trainer._sample_and_score(rows))  # tool metrics recorded

    envs = trainer.environments
    assert [type(e) for e in envs] == [CounterEnv, CounterEnv, EchoEnv, EchoEnv]
    assert all(e.seen == {} for e in envs)  # the routing column is not passed to reset
    first = trainer.contexts[0]  # the prompts: reset's text, with this environment's tools only
    for context in first[:2]:
        assert "- increment(step: integer)" in context and "shout" not in context
        assert context.endswith("<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n")
    for context in first[2:]:
        assert "- shout(text: string)" in context and "increment(" not in context
        assert context.endswith("<|im_start|>user\nEcho.<|im_end|>\n<|im_start|>assistant\n")
    assert [envs[0].counter, envs[1].counter, envs[2].said, envs[3].said] == [1, 0, "HI", ""]
    unknown = scored.completions[3][1]["content"]  # row 3 called the counter's tool from an echo episode
    assert unknown == "{\"error\": \"unknown tool 'increment'; the tools are ['shout'].\"}"
    # get_reward of CounterEnv is a second reward source; EchoEnv rows get None (NaN) from it.
    assert scored.rewards_per_func[:2, 1].tolist() == [1.0, 0.0]
    assert scored.rewards_per_func[2:, 1].isnan().all()
    # 3 calls answered (rows 0, 2, 3) in 4 episodes, 1 failed; 7 model turns (2 + 1 + 2 + 2).
    logged = {k: v[-1] for k, v in trainer.metrics.values["train"].items() if k.startswith("tools/")}
    assert logged == {
        "tools/call_frequency": 0.75,
        "tools/failure_frequency": 1 / 3,
        "tools/calls_per_episode": 0.75,
        "tools/failed_calls_per_episode": 0.25,
        "tools/turns_per_episode": 1.75,
    }


def test_instances_are_made_once_and_reset_for_every_batch(tmp_path):
    CounterEnv.made = 0
    trainer = trainer_for(
        tmp_path,
        args=dict(per_device_train_batch_size=4, num_generations=2),
        reward_funcs=length_reward,
        train_dataset=Dataset.from_dict({"environment": ["counter", "echo"]}),
        environment_factory={"counter": CounterEnv, "echo": EchoEnv},
    )
    trainer.script = lambda context, i: call("increment", step=1) if not answered(context) else "ok"
    assert CounterEnv.made == 1  # one made at construction, to read its tools and reward
    trainer._sample_and_score([{"environment": "counter"}] * 3 + [{"environment": "echo"}])
    first = trainer.environments[:3]
    assert CounterEnv.made == 3  # the pool grew to the 3 this batch needs
    trainer._sample_and_score([{"environment": "counter"}] * 2 + [{"environment": "echo"}] * 2)
    assert CounterEnv.made == 3 and trainer.environments[:2] == first[:2]  # reused
    assert [e.counter for e in trainer.environments[:2]] == [1, 1]  # reset: 0, then one call


def test_environments_reach_reward_functions_and_trainer_environments(tmp_path):
    seen = []

    def reward(completions, environments, **kwargs):
        seen.append(environments)
        return [float(e.counter) for e in environments]

    trainer = trainer_for(
        tmp_path, reward_funcs=reward, train_dataset=chat_dataset(2), environment_factory=CounterEnv
    )
    trainer.script = lambda context, i: call("increment", step=i) if not answered(context) else "ok"
    rows = [chat_dataset(2)[0]] * 4
    scored = recorded_episodes(trainer, trainer._sample_and_score(rows))  # tool metrics recorded
    assert seen[-1] is trainer.environments and len(trainer.environments) == 4
    # single factory: reset gets the whole row, prompt included (as TRL passes it)
    assert trainer.environments[0].seen == rows[0]
    assert trainer.contexts[0][0].endswith("What is 0 + 0?Count.<|im_end|>\n<|im_start|>assistant\n")
    assert scored.rewards_per_func.tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


class NotesEnv:
    """Holds a sqlite3 connection made in __init__, which sqlite3 lets only the thread that made it use,
    and uses it in reset, its tool and get_reward (an async one in `AsyncNotesEnv`)."""

    def __init__(self):
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE TABLE notes (text TEXT)")

    def reset(self, **kwargs) -> str:
        self.db.execute("DELETE FROM notes")
        return "Take notes."

    def note(self, text: str) -> str:
        """Writes a note down.

        Args:
            text: The note.
        """
        self.db.execute("INSERT INTO notes VALUES (?)", (text,))
        return "noted"

    def get_reward(self) -> float:
        return float(self.db.execute("SELECT COUNT(*) FROM notes").fetchone()[0])


class AsyncNotesEnv(NotesEnv):
    async def get_reward(self) -> float:
        return float(self.db.execute("SELECT COUNT(*) FROM notes").fetchone()[0])


@pytest.mark.parametrize("env", [NotesEnv, AsyncNotesEnv], ids=["sync", "async"])
def test_an_environment_holding_a_sqlite3_connection_works(tmp_path, env):
    """Each instance's calls (its making, reset, tools, get_reward) run on one thread of its own, as
    TRL's all run on the caller's; on a thread per call, sqlite3 refuses the connection."""
    trainer = trainer_for(tmp_path, train_dataset=chat_dataset(2), environment_factory=env)
    trainer.script = lambda context, i: call("note", text=f"row {i}") if not answered(context) else "ok"
    rows = [chat_dataset(2)[0]] * 4
    for _ in range(2):  # the second batch reuses the instances
        scored = recorded_episodes(trainer, trainer._sample_and_score(rows))
        assert scored.rewards_per_func[:, 0].tolist() == [1.0] * 4  # one note each, counted in get_reward
    assert trainer.metrics.values["train"]["tools/failure_frequency"] == [0.0, 0.0]


class AsyncCounterEnv(CounterEnv):
    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.counter) * 10


@pytest.mark.parametrize("env", [CounterEnv, AsyncCounterEnv], ids=["sync", "async"])
def test_an_environment_can_be_the_only_reward(tmp_path, env):
    trainer = trainer_for(tmp_path, train_dataset=chat_dataset(2), environment_factory=env)
    trainer.script = lambda context, i: call("increment", step=i) if not answered(context) else "ok"
    assert [f.__name__ for f in trainer.reward_funcs] == [env.__name__]
    assert trainer.reward_weights.tolist() == [1.0]
    scale = 10 if env is AsyncCounterEnv else 1
    scored = trainer._sample_and_score([chat_dataset(2)[0]] * 4)
    assert scored.rewards_per_func[:, 0].tolist() == [0.0, 1.0 * scale, 2.0 * scale, 3.0 * scale]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert f"reward/{env.__name__}" in trainer.state.log_history[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_reward_weights_weigh_the_reward_funcs_and_the_environment_counts_once(tmp_path):
    def two(completions, **kwargs):
        return [2.0] * len(completions)

    trainer = trainer_for(
        tmp_path,
        args=dict(reward_weights=[0.5]),
        reward_funcs=two,
        train_dataset=Dataset.from_dict({"environment": ["a", "b"]}),
        environment_factory={"a": CounterEnv, "b": CounterEnv},  # one class: one reward source
    )
    assert [f.__name__ for f in trainer.reward_funcs] == ["two", "CounterEnv"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    rewards_per_func = torch.tensor([[2.0, 3.0], [2.0, 0.0], [2.0, 1.0], [2.0, float("nan")]])
    args = trainer.args
    rewards, _ = batch_advantages(
        rewards_per_func, trainer.reward_weights, 2, args.multi_objective_aggregation, args.scale_rewards
    )  # the weighted sum
    assert rewards.tolist() == [4.0, 1.0, 2.0, 1.0]  # 0.5 * 2 + 3, 0.5 * 2 + 0, ..., 0.5 * 2 + (None: 0)


class GuessEnv:
    made = 0

    def __init__(self):
        GuessEnv.made += 1

    def reset(self, **kwargs) -> str:
        self.seen = kwargs
        return "Guess the word."

    def get_reward(self) -> float:
        return 0.0


def test_an_environment_that_owns_the_data_needs_no_dataset(tmp_path):
    GuessEnv.made = 0
    trainer = trainer_for(
        tmp_path,
        args=dict(max_steps=2),
        reward_funcs=lambda completions, **kw: [float(len(c[-1]["content"])) for c in completions],
        environment_factory=GuessEnv,
    )
    trainer.script = lambda context, i: "ab"[: i % 3]  # lengths 0, 1, 2: rewards that differ
    assert trainer.toolbox is None  # no tool anywhere: single-turn rollouts
    assert len(trainer.train_dataset) == 8 // 4  # one generation batch of placeholder prompts
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    prompt = "<|im_start|>user\nGuess the word.<|im_end|>\n<|im_start|>assistant\n"
    assert all(context == prompt for call_contexts in trainer.contexts for context in call_contexts)
    assert trainer.environments[0].seen == {"prompt": EMPTY_PROMPT}
    assert GuessEnv.made == 8  # 8 rows per batch, two batches: made once, reset twice
    assert not any(k.startswith("tools/") for k in trainer.state.log_history[0])


class SlowEnv:
    def reset(self, **kwargs) -> None:
        pass

    def wait(self, seconds: float) -> str:
        """Waits.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"


def test_an_environment_whose_call_timed_out_is_not_reused(tmp_path):
    trainer = trainer_for(
        tmp_path,
        args=dict(tool_timeout=0.1),
        reward_funcs=length_reward,
        train_dataset=chat_dataset(2),
        environment_factory=SlowEnv,
    )
    trainer.script = lambda context, i: (
        call("wait", seconds=[1.0, 0, 0, 0][i]) if not answered(context) else "ok"
    )
    rows = [chat_dataset(2)[0]] * 4
    recorded_episodes(trainer, trainer._sample_and_score(rows))  # tool metrics recorded
    first = trainer.environments
    assert trainer.metrics.values["train"]["tools/failure_frequency"] == [0.25]  # the timeout failed
    trainer._sample_and_score(rows)
    # Row 0's call timed out (its thread may still run on that instance): the pool dropped it, so
    # rows 0-2 get the other three and row 3 a new one.
    assert trainer.environments[:3] == first[1:] and all(trainer.environments[3] is not e for e in first)


class StuckEnv:
    """Instance 0 of a run blocks in `stuck` (reset or get_reward) until `release` is set (at most
    10 s: without a time limit the call would return then, and no error come)."""

    release = threading.Event()
    stuck = "reset"
    made = 0

    def __init__(self):
        self.index, StuckEnv.made = StuckEnv.made, StuckEnv.made + 1

    def _maybe_block(self, method: str) -> None:
        if self.index == 0 and method == self.stuck:
            StuckEnv.release.wait(10)

    def reset(self, **kwargs) -> None:
        self._maybe_block("reset")

    def get_reward(self) -> float:
        self._maybe_block("get_reward")
        return 1.0


class AsyncStuckEnv(StuckEnv):
    async def get_reward(self) -> float:
        self._maybe_block("get_reward")
        return 1.0


@pytest.fixture
def stuck_env():
    StuckEnv.made, StuckEnv.release = 0, threading.Event()
    yield StuckEnv
    StuckEnv.release.set()  # let the abandoned calls end


def test_a_reset_that_hangs_fails_after_environment_timeout(stuck_env):
    pool = EnvironmentPool(stuck_env, 0.2)
    with pytest.raises(
        TimeoutError, match=r"StuckEnv.reset\(\) did not return within 0.2 s \(environment_timeout=0.2\)"
    ):
        pool.start_episodes([{"prompt": [{"role": "user", "content": "x"}]}])


@pytest.mark.parametrize("env", [StuckEnv, AsyncStuckEnv], ids=["sync", "async"])
def test_a_get_reward_that_hangs_fails_after_environment_timeout(tmp_path, stuck_env, env, monkeypatch):
    monkeypatch.setattr(StuckEnv, "stuck", "get_reward")
    trainer = trainer_for(tmp_path, args=dict(environment_timeout=0.2), environment_factory=env)
    trainer.script = lambda context, i: "ok"
    pattern = rf"{env.__name__}.get_reward\(\) did not return within 0.2 s \(environment_timeout=0.2\)"
    with pytest.raises(RuntimeError, match=pattern):  # a failing reward function (reward_error_policy)
        trainer._sample_and_score([chat_dataset(2)[0]] * 4)


def test_an_environment_whose_get_reward_timed_out_is_not_reused(tmp_path, stuck_env, monkeypatch):
    monkeypatch.setattr(StuckEnv, "stuck", "get_reward")
    args = dict(environment_timeout=0.2, reward_error_policy="zero")
    trainer = trainer_for(tmp_path, args=args, environment_factory=StuckEnv)
    trainer.script = lambda context, i: "ok"
    rows = [chat_dataset(2)[0]] * 4
    scored = recorded_episodes(trainer, trainer._sample_and_score(rows))  # tool metrics recorded
    assert scored.rewards_per_func[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0] and scored.errors == 1
    first = trainer.environments
    trainer._sample_and_score(rows)
    assert [e.index for e in first] == [0, 1, 2, 3]
    assert [e.index for e in trainer.environments] == [1, 2, 3, 4]  # 0 left the pool, a new one came


def test_environment_timeout_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="environment_timeout must be > 0 seconds"):
        make_config(tmp_path, environment_timeout=0)


# ---- Errors, at construction --------------------------------------------------------------------


def test_errors_name_what_to_change(tmp_path):
    args = make_config(tmp_path)
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(tiny_llama(), length_reward, args, processing_class=TOKENIZER)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(
            tiny_llama(),
            length_reward,
            args,
            processing_class=TOKENIZER,
            environment_factory={"c": CounterEnv},
        )
    with pytest.raises(ValueError, match="set max_steps"):
        GRPOTrainer(
            tiny_llama(), length_reward, make_config(tmp_path, max_steps=-1), environment_factory=CounterEnv
        )
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(tiny_llama(), None, args, chat_dataset(2), processing_class=TOKENIZER, tools=[])
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(tiny_llama(), None, args, chat_dataset(2), environment_factory=EchoEnv)
    with pytest.raises(ValueError, match="has no reset method"):
        GRPOTrainer(tiny_llama(), length_reward, args, chat_dataset(2), environment_factory=object)
    routed = {"counter": CounterEnv, "echo": EchoEnv}
    with pytest.raises(ValueError, match="has no 'environment' column"):
        GRPOTrainer(tiny_llama(), length_reward, args, chat_dataset(2), environment_factory=routed)
    with pytest.raises(ValueError, match=r"'environment' values \['game'\] are not among the environments"):
        GRPOTrainer(
            tiny_llama(),
            length_reward,
            args,
            Dataset.from_dict({"environment": ["counter", "game"]}),
            environment_factory=routed,
        )


def test_pool_errors_and_reset_text():
    pool = EnvironmentPool({"counter": CounterEnv}, 5.0)
    with pytest.raises(ValueError, match="`environment='game'`, which is not among the environments"):
        pool.start_episodes([{"environment": "game"}])

    class Odd:
        def reset(self, **kwargs):
            return 3

    with pytest.raises(TypeError, match="Odd.reset returned int; return None or a str"):
        EnvironmentPool(Odd, 5.0).start_episodes([{"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="empty dict"):
        EnvironmentPool({}, 5.0)
    check_reward_source([length_reward])


def test_no_dataset_placeholder_is_one_generation_batch_of_empty_prompts(tmp_path):
    args = make_config(tmp_path, per_device_train_batch_size=12, num_generations=4)
    placeholder = train_dataset_or_placeholder(None, EnvironmentPool(GuessEnv, 5.0), args)
    assert placeholder["prompt"] == [EMPTY_PROMPT] * 3
    dataset = chat_dataset(2)
    assert train_dataset_or_placeholder(dataset, None, args) is dataset
