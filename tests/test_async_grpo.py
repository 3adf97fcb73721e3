"""Async GRPO (max_staleness >= 1) against the fake vLLM server: TRL's API, the rounds' versions and
the overlap, staleness and drops, the metrics, exact resume, faults, and two processes. The real
server is exercised by tests_vllm/."""

import asyncio
import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_vllm_server import FakeVLLMServer
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, exact_resume, length_reward, make_config
from transformers import TrainerCallback
from two_processes import launch_two_processes

import grpo_hf.trainer
from grpo_hf import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOTrainer
from grpo_hf.data import rollout
from grpo_hf.engine.vllm.requests import request_seed
from grpo_hf.episodes.async_rounds import ASYNC_FILE
from grpo_hf.rewards import reward_outputs
from grpo_hf.training.checkpoints import STATE_FILE

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
SERVER = dict(use_vllm=True, vllm_mode="server", vllm_server_timeout=5.0)


@pytest.fixture
def server():
    fake = FakeVLLMServer(EOS)
    yield fake
    fake.close()


def trainer_for(tmp_path, url: str, callbacks=None, reward=length_reward, eval_dataset=None, **overrides):
    """4 steps of 2 prompts x 4 completions (one round per step) through the server at `url`."""
    settings = SERVER | dict(vllm_server_base_url=url, max_staleness=1, max_steps=4) | overrides
    return GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=reward,
        args=make_config(tmp_path, **settings),
        train_dataset=chat_dataset(),
        eval_dataset=eval_dataset,
        processing_class=TOKENIZER,
        callbacks=callbacks,
    )


def rounds_requested(server: FakeVLLMServer, versions: list[int], processes: int = 1) -> list[list]:
    """The prompts the server was asked for, round by round, found by their request seeds: round r
    sampled from policy version versions[r] in one call (`request_seed(seed 0, version, 'round r.0',
    k x processes + p)`, k a prompt's place in process p's share). A request whose seed fits no
    (round, version) fails."""
    keys = range(2 * processes)
    seeds = {
        request_seed(0, version, f"round {r}.0", key): r for r, version in enumerate(versions) for key in keys
    }
    prompts = [[] for _ in versions]
    for body in server.completions():
        assert body["seed"] in seeds, f"a request from no expected (round, version): {body['seed']}"
        prompts[seeds[body["seed"]]].append(TOKENIZER.decode(body["prompt"]))
    return [sorted(p) for p in prompts]


def logged(trainer: GRPOTrainer, name: str) -> list[float]:
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def no_generation_thread() -> bool:
    return not any(thread.name == "grpo-async-rounds" for thread in threading.enumerate())


# ---- API: TRL's names -----------------------------------------------------------------------------------


def test_async_grpo_config_has_trls_async_defaults(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], request_timeout=30)
    assert (config.max_staleness, config.weight_sync_steps, config.queue_maxsize) == (4, 1, 1024)
    assert (config.max_inflight_tasks, config.heartbeat_stale_after_s) == (-1, 300.0)
    assert (
        config.use_vllm and config.vllm_mode == "server" and config.vllm_base_url == "http://localhost:8000"
    )
    assert (
        config.logging_steps == 1
        and config.lr_scheduler_type == "constant"
        and config.num_completions_to_print == 3
    )
    assert config.max_completion_length == 2048 and config.vllm_server_request_timeout == 30
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_staleness=0)


def test_colocated_generation_cannot_overlap(tmp_path, monkeypatch):
    """vLLM colocate shares the device with training: async GRPO is refused, naming the settings."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if vLLM were installed
    with pytest.raises(ValueError, match="vllm_mode='colocate'.*vllm_mode='server'.*max_staleness=0"):
        make_config(tmp_path, use_vllm=True, max_staleness=1)


def test_async_grpo_trainer_takes_trls_arguments_in_trls_order(tmp_path, server):
    """TRL's positional order (model, reward_funcs, args, train_dataset, processing_class); a
    synchronous config is refused, naming max_staleness."""
    args = make_config(tmp_path, **SERVER, vllm_server_base_url=server.url, max_staleness=2)
    trainer = AsyncGRPOTrainer(tiny_llama(), length_reward, args, chat_dataset(), TOKENIZER)
    assert isinstance(trainer, GRPOTrainer) and trainer.processing_class is TOKENIZER
    assert trainer.async_rounds is not None and trainer.eval_dataset is None
    synchronous = make_config(tmp_path, **SERVER, vllm_server_base_url=server.url)
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncGRPOTrainer(tiny_llama(), length_reward, synchronous, chat_dataset(), TOKENIZER)


def tokenized(trainer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = trainer.processing_class
    texts = [rollout.render_prompt(tokenizer, prompt) for prompt in prompts]
    return rollout.tokenize_prompts(tokenizer, texts, None, trainer.accelerator.device)


def rollout_output(ids, mask, result: rollout.Rollout) -> dict:
    """A rollout_func's output: the prompts and `result`'s completions and sampler log-probs."""
    completion = result.completion_mask.bool()
    return {
        "prompt_ids": [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)],
        "completion_ids": [row[m].tolist() for row, m in zip(result.completion_ids, completion, strict=True)],
        "logprobs": [row[m].tolist() for row, m in zip(result.sampler_logps, completion, strict=True)],
    }


def test_a_rollout_func_samples_on_the_generation_thread(tmp_path, server):
    """A rollout_func's generate_completions calls, on the generation thread, sample this process's
    rows alone from the round's policy version, as many calls as it likes (here two, the first cut
    to 2 tokens), each with its own request seeds: the second call's samples are not the first's
    again (the fake server's first token follows the seed)."""
    calls = []

    def rollout_func(prompts, trainer):
        ids, mask = tokenized(trainer, prompts)
        first, second = (trainer.generate_completions(ids, mask, limit) for limit in (2, None))
        again = torch.equal(first.completion_ids[:, 0], second.completion_ids[:, 0])
        calls.append((threading.current_thread().name, first.completion_mask.sum(dim=1).max().item(), again))
        return rollout_output(ids, mask, second)

    args = make_config(tmp_path, **SERVER, vllm_server_base_url=server.url, max_staleness=1, max_steps=3)
    trainer = GRPOTrainer(
        tiny_llama(),
        length_reward,
        args,
        chat_dataset(),
        processing_class=TOKENIZER,
        rollout_func=rollout_func,
    )
    trainer.train()
    # Three rounds, each sampled ahead, the first call cut to 2, the second with samples of its own.
    assert calls == [("grpo-async-rounds", 2, False)] * 3
    seeds = [body["seed"] for body in server.completions()]
    assert len(seeds) == len(set(seeds)) == 3 * 2 * 2  # 3 rounds x 2 calls x 2 distinct prompts
    assert logged(trainer, "sample/staleness_max") == [0, 1, 1]
    assert no_generation_thread()


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def tool_then_answer(prompt, j, body):
    """The fake server's model: call `add` in the first turn, answer 'done' once a tool result is in
    the context."""
    answered = "<|im_start|>tool" in TOKENIZER.decode(prompt)
    text = "done" if answered else '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    return TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]


class Ledger:
    """An environment whose tool is `add` and whose reward is its calls; it fails loudly if an
    instance is reset while its episode is not scored yet (two episodes on one instance at once)."""

    def __init__(self):
        self.calls, self.open = 0, False

    def reset(self, **row) -> None:
        assert not self.open, "an instance was drawn for two episodes at once"
        self.calls, self.open = 0, True

    def add(self, a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        self.open = False
        return float(self.calls)


@pytest.mark.parametrize("source", ["tools", "environment_factory"])
def test_tool_episodes_run_on_the_generation_thread(tmp_path, source):
    """Multi-turn tool episodes, with tools or environments, sampled ahead on the generation thread
    (this process's rows alone), their tool metrics recorded on the training thread; with
    environments, evaluation between the rounds draws from the same pool without sharing an instance."""
    fake = FakeVLLMServer(EOS, tool_then_answer)
    try:
        extra = {"tools": [add]} if source == "tools" else {"environment_factory": Ledger}
        settings = SERVER | dict(vllm_server_base_url=fake.url, max_staleness=1, max_steps=3)
        settings |= dict(max_completion_length=128, eval_strategy="steps", eval_steps=1)
        trainer = GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path, **settings),
            train_dataset=chat_dataset(),
            eval_dataset=chat_dataset(2),
            processing_class=TOKENIZER,
            **extra,
        )
        trainer.train()
    finally:
        fake.close()
    turns = [TOKENIZER.decode(body["prompt"]) for body in fake.completions()]
    with_result = sum("<|im_start|>tool" in t for t in turns)
    assert with_result == len(turns) / 2 > 0  # every episode: a tool call, then an answer with its result
    assert logged(trainer, "tools/call_frequency") == [1.0] * 3 and len(logged(trainer, "eval_reward")) == 3
    assert logged(trainer, "sample/staleness_max") == [0, 1, 1]
    if source == "environment_factory":
        assert (
            logged(trainer, "reward/Ledger") == [1.0] * 3
        )  # each episode's one call, scored on its instance
    assert no_generation_thread()


def some_teach(completion_ids, answer, **kwargs):
    """Prompts 1, 3, ... teach (their samples' lengths differ); the others score 1 throughout."""
    return [
        float(len(ids)) if int(a) % 4 == 2 else 1.0 for ids, a in zip(completion_ids, answer, strict=True)
    ]


def sampling_twice(prompts, trainer):
    """A rollout_func sampling the prompts twice, training on the second call's samples."""
    ids, mask = tokenized(trainer, prompts)
    trainer.generate_completions(ids, mask)
    return rollout_output(ids, mask, trainer.generate_completions(ids, mask))


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("source", ["rollout_func", "tool_turns", "extra_rounds"])
def test_no_two_requests_share_a_seed(tmp_path, max_staleness, source):
    """Every request of 3 steps has a seed of its own, synchronous or async: a rollout_func's two calls
    of one round, the turns of tool episodes, and dynamic sampling's extra rounds (sampled on the
    training thread, beside the generation thread's rounds)."""
    fake = FakeVLLMServer(EOS, tool_then_answer if source == "tool_turns" else None)
    settings = SERVER | dict(vllm_server_base_url=fake.url, max_staleness=max_staleness, max_steps=3)
    extra, reward = {}, length_reward
    if source == "rollout_func":
        extra = {"rollout_func": sampling_twice}
    elif source == "tool_turns":
        extra, settings = {"tools": [add]}, settings | dict(max_completion_length=128)
    else:
        reward, settings = some_teach, settings | dict(dynamic_sampling=True, max_dynamic_sampling_rounds=4)
    try:
        GRPOTrainer(
            tiny_llama(),
            reward,
            make_config(tmp_path, **settings),
            chat_dataset(),
            processing_class=TOKENIZER,
            **extra,
        ).train()
    finally:
        fake.close()
    seeds = [body["seed"] for body in fake.completions()]
    assert len(seeds) > 3 * 2 and len(set(seeds)) == len(seeds)  # more than one call for 3 rounds x 2 prompts


# ---- The rounds: versions, overlap, data order, metrics ---------------------------------------------


def test_the_wait_for_a_slow_server_is_logged_whether_met_at_a_take_or_at_a_sync(tmp_path, server):
    """Each request takes 0.4 s and training almost nothing: after round 0 the trainer waits ~0.4 s a
    step, mostly at the sync (which first lets the thread finish the round it was given), so
    perf/rollout_wait_s counts that wait with the next take; step_time (to the optimizer update)
    does not see it."""
    server.delay = 0.4
    trainer = trainer_for(tmp_path, server.url)
    trainer.train()
    waits = logged(trainer, "perf/rollout_wait_s")
    assert len(waits) == 4 and min(waits[1:]) > 0.25, waits


@pytest.mark.parametrize(
    ("sync_steps", "versions", "staleness", "ahead"),
    [(1, [0, 0, 1, 2], [0, 1, 1, 1], 2), (2, [0, 0, 0, 0], [0, 0, 1, 1], 4)],
    ids=["sync-every-step", "sync-every-2-steps"],
)
def test_rounds_are_sampled_one_sync_ahead_in_the_samplers_order(
    tmp_path, server, sync_steps, versions, staleness, ahead
):
    """Every 1 step: round 1 is sampled from the initial weights (version 0) while the trainer trains
    on round 0, round r >= 2 from version r - 1; staleness 0 for round 0, then 1. Every 2 steps:
    rounds 0-3 are all in sync intervals 0 and 1, so all come from version 0, and rounds 2-3 are 1
    version old when trained. The weights go to the server once per version a round is sampled from
    (the versions of the last syncs precede no round). A round's requests take 0.3 s and a step 0.6 s:
    the thread samples the next rounds while the trainer trains, which waits for round 0 only
    (perf/rollout_wait_s). The prompts are those of synchronous training, round by round."""

    class SlowStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # before the sync's wait for the thread
            time.sleep(0.6)

    server.delay = 0.3
    trainer = trainer_for(
        tmp_path / "async", server.url, callbacks=[SlowStep()], weight_sync_steps=sync_steps
    )
    trainer.train()
    async_rounds = rounds_requested(server, versions)
    paths = [path for path, _ in server.requests if path in ("/collective_rpc", "/v1/completions")]
    sent = [i for i, path in enumerate(paths) if path == "/collective_rpc"]
    assert len(sent) == len(set(versions))  # the initial weights, then each version a round is sampled from
    before_first_sync = paths[: (sent[1:] or [len(paths)])[0]].count("/v1/completions")
    assert before_first_sync == 2 * ahead  # rounds sampled before the first weights sent after a step
    assert logged(trainer, "sample/staleness_mean") == logged(trainer, "sample/staleness_max") == staleness
    assert len(logged(trainer, "perf/weight_sync_s")) == len(sent) - 1
    waits = logged(trainer, "perf/rollout_wait_s")
    assert len(waits) == 4 and waits[0] > 0.25 and max(waits[1:]) < 0.15, waits
    assert (
        len(logged(trainer, "rollout/generated_tok_s")) == 4
        and min(logged(trainer, "rollout/generated_tok_s")) > 0
    )
    assert "sample/rollout_queue_size" in trainer.state.log_history[0]
    assert no_generation_thread()

    synchronous = FakeVLLMServer(EOS)
    try:
        trainer_for(tmp_path / "sync", synchronous.url, max_staleness=0).train()
        seeds = {request_seed(0, step, 1, k): step for step in range(4) for k in range(2)}  # version = step
        sync_rounds = [[] for _ in range(4)]
        for body in synchronous.completions():
            sync_rounds[seeds[body["seed"]]].append(TOKENIZER.decode(body["prompt"]))
    finally:
        synchronous.close()
    assert async_rounds == [sorted(p) for p in sync_rounds]  # the sampler's order, each prompt once


class Parameters(TrainerCallback):
    """The policy's parameters at the end of each optimizer step, by global_step."""

    def __init__(self):
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_weights_go_to_the_server_only_for_versions_rounds_are_sampled_from(tmp_path, server):
    """A round spans 4 optimizer steps (steps_per_generation=4, gradient_accumulation_steps=1) and the
    weights sync every step: of 12 syncs, only those of steps 3 and 7 precede a round (rounds 1 and 2,
    read one sync before they are trained). The server gets the initial weights and those two
    versions, each the parameters after its step, not a whole model every step."""
    parameters = Parameters()
    trainer = trainer_for(
        tmp_path, server.url, callbacks=[parameters], max_steps=12, per_device_train_batch_size=2,
        steps_per_generation=4, gradient_accumulation_steps=1,
    )  # fmt: skip
    trainer.train()
    assert all(rounds_requested(server, [0, 3, 7]))  # rounds 0-2 from versions 0, 3 and 7
    initial, third, seventh = server.loaded
    assert all(torch.equal(third[name], value) for name, value in parameters.after[3].items())
    assert all(torch.equal(seventh[name], value) for name, value in parameters.after[7].items())
    assert not torch.equal(initial["lm_head.weight"], third["lm_head.weight"])
    assert len(logged(trainer, "perf/weight_sync_s")) == 2 and logged(trainer, "sample/staleness_max") == [
        0,
        1,
        1,
    ]


def test_evaluation_samples_from_the_synced_weights(tmp_path, server):
    """Evaluation in async mode samples from the weights the server holds: no extra weight update."""
    trainer = trainer_for(
        tmp_path, server.url, max_steps=2, eval_dataset=chat_dataset(2), eval_strategy="steps", eval_steps=1
    )
    trainer.train()
    assert len(logged(trainer, "eval_reward")) == 2
    assert sum(path == "/collective_rpc" for path, _ in server.requests) == 3  # initial + 2 syncs


def test_async_reward_functions_are_awaited_on_the_generation_thread(tmp_path, server):
    """An `async def` reward is awaited and a plain one called (on the generation thread), in this
    process: closures, nothing pickled."""
    called_on = set()

    async def judged(completions, **kwargs):
        await asyncio.sleep(0)
        return [len(c[0]["content"]) / 10 for c in completions]

    def plain(completions, **kwargs):
        called_on.add(threading.current_thread().name)
        return length_reward(completions)

    trainer = trainer_for(tmp_path, server.url, max_steps=2, reward=[judged, plain])
    trainer.train()
    assert called_on == {"grpo-async-rounds"}
    assert len(logged(trainer, "reward/judged")) == 2
    assert logged(trainer, "reward/judged") == logged(trainer, "reward/plain")  # the same lengths


@pytest.mark.parametrize(
    ("max_staleness", "steps"), [(0, [0, 1, 2, 3]), (1, [0, 0, 1, 2])], ids=["sync", "async"]
)
def test_reward_functions_see_the_trainer_state_of_their_rounds_policy_version(
    tmp_path, server, max_staleness, steps
):
    """trainer_state.global_step is the optimizer steps in the weights that sampled the round: in sync
    training the step training it; in async GRPO the version's sync step (rounds 0 and 1 from the
    initial weights, round r >= 2 from version r - 1), even when the reward reads it after the
    trainer has moved on (here: after step r - 1 ended), not the live step."""
    ended = [threading.Event() for _ in range(4)]
    seen = []

    class Ended(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ended[state.global_step - 1].set()

    def curriculum(completions, trainer_state, **kwargs):
        if max_staleness and seen:  # round r >= 1 is scored on the thread while step r - 1 trains
            ended[len(seen) - 1].wait(timeout=30)
        seen.append(trainer_state.global_step)
        return length_reward(completions)

    trainer_for(
        tmp_path, server.url, reward=curriculum, callbacks=[Ended()], max_staleness=max_staleness
    ).train()
    assert seen == steps


def test_dynamic_sampling_tops_rounds_up_from_the_synced_weights(tmp_path, server):
    """DAPO dynamic sampling in async mode: a round taken from the queue with groups that do not
    teach is topped up by extra rounds, sampled on the training thread (every process in step) from
    the weights the server holds; the batch keeps only groups that teach."""

    threads = set()

    def some_teach_here(completion_ids, answer, **kwargs):
        threads.add(threading.current_thread().name)
        return some_teach(completion_ids, answer)

    spread = []

    class Batches(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # the step's round is in the buffer
            advantages = torch.cat([part["advantages"] for part in trainer._buffer]).view(-1, 4)
            spread.append(bool((advantages != 0).any(dim=1).all()))

    trainer = trainer_for(
        tmp_path, server.url, reward=some_teach_here, callbacks=[Batches()], max_steps=3, dynamic_sampling=True,
        max_dynamic_sampling_rounds=4, beta=0.0,
    )  # fmt: skip
    trainer.train()
    assert spread == [True, True, True]
    assert sum(logged(trainer, "dynamic_sampling/extra_rounds")) > 0
    assert threads == {"grpo-async-rounds", threading.main_thread().name}  # queued rounds, then extra ones
    assert no_generation_thread()


# ---- Staleness: drops -------------------------------------------------------------------------------


class StopAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_a_round_older_than_max_staleness_is_dropped_counted_and_sampled_again(tmp_path, server):
    """A checkpoint's queue holds round 2 (version 1); restored with the version counter at 9, it is 8
    versions old: dropped (its 8 completions counted), and its prompts sampled again from version 9."""
    trainer_for(tmp_path, server.url, save_strategy="steps", save_steps=2, callbacks=[StopAfter(2)]).train()
    path = tmp_path / "checkpoint-2" / ASYNC_FILE.format(0)
    saved = torch.load(path, weights_only=True)
    assert saved["version"] == 2 and [(r["index"], r["version"]) for r in saved["rounds"]] == [(2, 1)]
    torch.save(saved | {"version": 9}, path)
    first = rounds_requested(server, [0, 0, 1])
    server.requests.clear()
    resumed = trainer_for(tmp_path, server.url, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert logged(resumed, "sample/dropped_stale_total") == [8.0]  # round 2, at step 3
    again = rounds_requested(server, [None, None, 9, 9])  # round 3 read at step 3, from version 9 too
    assert again[2] == first[2] and again[:2] == [[], []]  # the same prompts, from version 9
    assert logged(resumed, "sample/staleness_mean")[2:] == [0.0, 1.0]  # steps 3-4 (1-2: the checkpoint's log)


def numpy_logging_reward(completions, log_extra, **kwargs):
    """The length reward, also logged as a completions-table column of NumPy values."""
    values = np.array(length_reward(completions))
    log_extra("length", values)
    return values.tolist()


def test_a_checkpoint_whose_rounds_hold_what_rewards_logged_resumes(tmp_path, server):
    """A reward function logs NumPy values with log_extra; the checkpoint of step 2 holds round 2 (sampled
    ahead) with them: resume_from_checkpoint=True reads it back and trains on to step 4."""
    saving = dict(reward=numpy_logging_reward, save_strategy="steps", save_steps=2)
    trainer_for(tmp_path, server.url, callbacks=[StopAfter(2)], **saving).train()
    resumed = trainer_for(tmp_path, server.url, **saving)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4


def test_a_checkpoint_that_cannot_be_read_back_fails_when_saved(tmp_path, server, monkeypatch):
    """Should a queued round hold a value torch.load(weights_only=True) refuses (here log_extra made to keep
    NumPy values), saving fails at once, naming the file, and the checkpoint is not marked complete."""
    monkeypatch.setattr(reward_outputs, "cell_value", lambda value: value)
    trainer = trainer_for(
        tmp_path, server.url, reward=numpy_logging_reward, save_strategy="steps", save_steps=2
    )
    with pytest.raises(ValueError, match=r"grpo_async_0.pt.tmp .* cannot be read back.*numpy"):
        trainer.train()
    assert trainer.state.global_step == 2 and no_generation_thread()
    assert not (tmp_path / "checkpoint-2" / STATE_FILE).exists()


# ---- Exact resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop_after", "settings"),
    [(2, {}), (1, {"steps_per_generation": 2})],
    ids=["between-rounds", "mid-round"],
)
def test_resume_continues_exactly_no_prompt_lost_or_seen_twice(tmp_path, stop_after, settings):
    """4 steps straight == stop_after steps, stop, resume: the same requests (prompts, seeds: the
    same versions) over both parts, none twice, and bit-identical parameters. Between rounds, the
    checkpoint holds the round sampled ahead, which the resumed run does not sample again."""

    def requests(fake):
        return sorted((tuple(b["prompt"]), b["seed"], b["n"]) for b in fake.completions())

    straight_server, stopped_server, resumed_server = (FakeVLLMServer(EOS) for _ in range(3))
    settings = settings | exact_resume()
    try:
        straight = trainer_for(tmp_path / "straight", straight_server.url, **settings)
        straight.train()
        output = tmp_path / "interrupted"
        saving = dict(save_strategy="steps", save_steps=1, **settings)
        trainer_for(output, stopped_server.url, callbacks=[StopAfter(stop_after)], **saving).train()
        resumed = trainer_for(output, resumed_server.url, **saving)
        resumed.train(resume_from_checkpoint=str(output / f"checkpoint-{stop_after}"))
        both = sorted(requests(stopped_server) + requests(resumed_server))
        assert both == requests(straight_server)
        if stop_after == 2:
            assert len(requests(resumed_server)) == 2  # round 3 only: round 2 came from the checkpoint
    finally:
        for fake in (straight_server, stopped_server, resumed_server):
            fake.close()
    for (name, a), (_, b) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


class TrainedRounds:
    """The prompts (their numbers) of each round trained, in order, recorded where the trainer prepares a
    round it trains on (`recorded_episodes`)."""

    def __init__(self, monkeypatch):
        self.rounds: list[list[str]] = []
        record = grpo_hf.trainer.recorded_episodes

        def recorded(trainer, scored):
            if trainer.model.training:
                self.rounds.append(sorted({p[0]["content"].split()[2] for p in scored.prompts}))
            return record(trainer, scored)

        monkeypatch.setattr(grpo_hf.trainer, "recorded_episodes", recorded)


def test_epochs_with_a_short_last_step_keep_the_samplers_order_straight_and_resumed(tmp_path, monkeypatch):
    """10 prompts, 2 a round, 2 rounds an optimizer step (gradient_accumulation_steps=2,
    steps_per_generation=1): each epoch's last step takes 1 round. Over 2 epochs async GRPO trains the
    rounds of synchronous training in its order, none dropped or sampled twice; stopped after step 4
    (inside epoch 2) and resumed, the same rounds again, none lost or trained twice."""
    trained = TrainedRounds(monkeypatch)
    settings = dict(max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=2, steps_per_generation=1)

    def run(folder, max_staleness, **more):
        fake = FakeVLLMServer(EOS)
        try:
            more = settings | more | SERVER | dict(vllm_server_base_url=fake.url, max_staleness=max_staleness)
            trainer = GRPOTrainer(
                tiny_llama(), length_reward, make_config(folder, **more), chat_dataset(10), processing_class=TOKENIZER,
                callbacks=[StopAfter(4)] if "save_steps" in more else None,
            )  # fmt: skip
            trainer.train(resume_from_checkpoint=more.get("resume_from_checkpoint"))
        finally:
            fake.close()
        rounds, trained.rounds = trained.rounds, []
        return trainer, rounds, len(fake.completions())

    _, synchronous, _ = run(tmp_path / "sync", 0)
    assert len(synchronous) == 10 and synchronous[:5] != synchronous[5:]  # 2 epochs of 5 rounds, reshuffled
    straight, rounds, requests = run(tmp_path / "straight", 1)
    assert rounds == synchronous and requests == 10 * 2  # each round sampled once: 2 prompts
    assert straight.state.global_step == 6 and not logged(straight, "sample/dropped_stale_total")
    _, before, _ = run(tmp_path / "stopped", 1, save_strategy="steps", save_steps=4)
    resumed, after, requests = run(
        tmp_path / "stopped", 1, resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4")
    )
    assert before + after == synchronous and resumed.state.global_step == 6
    assert len(before) == 7 and requests == 2  # round 9's 2 prompts: rounds 7 and 8 came from the checkpoint


def test_a_checkpoint_trained_on_other_data_is_refused_before_training(tmp_path, server):
    """The checkpoint's count of micro-batches trained disagrees with where the Trainer resumes (another
    dataset or batch layout; here the count edited): a clear error, naming the settings, before any step."""
    trainer_for(tmp_path, server.url, save_strategy="steps", save_steps=2, callbacks=[StopAfter(2)]).train()
    path = tmp_path / "checkpoint-2" / ASYNC_FILE.format(0)
    saved = torch.load(path, weights_only=True)
    assert saved["trained"] == 2
    torch.save(saved | {"trained": 3}, path)
    resumed = trainer_for(tmp_path, server.url)
    with pytest.raises(
        ValueError, match="trained 3 micro-batches.*resumes after 2.*gradient_accumulation_steps"
    ):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 2 and no_generation_thread()


# ---- Faults ---------------------------------------------------------------------------------------------


def test_a_server_dying_mid_run_stops_with_its_error_and_the_run_resumes(tmp_path, server):
    """Rounds 0 and 1 are answered, round 2 meets a dead server: a ConnectionError within seconds, the
    checkpoint of step 1 complete, no thread left; a new server and resume_from_checkpoint=True finish."""
    server.die_after = 4  # 2 requests a round
    trainer = trainer_for(tmp_path, server.url, save_strategy="steps", save_steps=1)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="it stopped"):
        trainer.train()
    assert time.monotonic() - start < 30 and no_generation_thread()
    assert (tmp_path / "checkpoint-1" / STATE_FILE).is_file()
    assert not (tmp_path / "checkpoint-2" / STATE_FILE).exists()
    second = FakeVLLMServer(EOS)
    try:
        resumed = trainer_for(tmp_path, second.url, save_strategy="steps", save_steps=1)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 4
    finally:
        second.close()


def test_a_request_timing_out_and_a_stuck_server_are_errors_within_seconds(tmp_path, server):
    server.delay = 5.0
    timing_out = trainer_for(tmp_path / "request", server.url, vllm_server_request_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="vllm_server_request_timeout"):
        timing_out.train()
    assert time.monotonic() - start < 4 and no_generation_thread()
    stuck = trainer_for(tmp_path / "heartbeat", server.url, heartbeat_stale_after_s=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="heartbeat_stale_after_s=1"):
        stuck.train()
    assert time.monotonic() - start < 4 and no_generation_thread()  # the requests in flight aborted


def test_a_reward_function_raising_reaches_the_trainer_as_itself(tmp_path, server):
    """It raises on round 1, on the generation thread: the trainer raises scoring's error (naming the
    function and its exception) at its next wait, the end of step 1, before sending new weights."""
    calls = []

    def down_from_round_1(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) > 1:
            raise ValueError("the grader is down")
        return [1.0] * len(completions)

    trainer = trainer_for(tmp_path, server.url, reward=down_from_round_1)
    with pytest.raises(RuntimeError, match="'down_from_round_1' raised ValueError: the grader is down"):
        trainer.train()
    assert trainer.state.global_step == 1 and no_generation_thread()
    assert [path for path, _ in server.requests].count("/collective_rpc") == 1  # the initial weights only


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_a_base_exception_from_a_reward_function_reaches_the_trainer_at_once(tmp_path, server, max_staleness):
    """An async reward function raising asyncio.CancelledError (a BaseException, not an Exception) on
    round 1: train() raises it at step 1 in async GRPO (scored on the generation thread) as in
    synchronous training, not after heartbeat_stale_after_s with the server blamed."""
    calls = []

    async def judge(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) > 1:
            raise asyncio.CancelledError("judge request cancelled")
        return [1.0] * len(completions)

    trainer = trainer_for(
        tmp_path, server.url, reward=judge, max_staleness=max_staleness, heartbeat_stale_after_s=60.0
    )
    start = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        trainer.train()
    assert time.monotonic() - start < 30 and trainer.state.global_step == 1 and no_generation_thread()


def test_an_error_on_the_training_thread_aborts_the_requests_in_flight(tmp_path, server):
    """Rounds 1-3 are in flight on a server that holds them when training fails: train() ends at
    once, the requests aborted, no thread left. The server answers them only after train() has
    returned (or after 60 s): a request left waiting holds the generation thread past stop()'s 30 s
    join, so the bound below fails then, and only then, however loaded the machine."""

    class Fails(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise RuntimeError("out of memory, say")

    answered, trained = [], threading.Event()

    def held_after_round_0(prompt, j, body):
        answered.append(j)
        if answered.count(0) > 2:  # a request of round 1 or later (2 requests a round)
            trained.wait(60.0)
        return server._pattern(prompt, j, body)

    server.completion = held_after_round_0
    trainer = trainer_for(tmp_path, server.url, weight_sync_steps=2, callbacks=[Fails()])
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            trainer.train()
        seconds = time.monotonic() - start
    finally:
        trained.set()
    assert seconds < 30 and answered.count(0) > 2 and no_generation_thread()


def test_sigterm_stops_cleanly_with_a_complete_checkpoint(tmp_path, server):
    """SIGTERM during step 1: the step ends, a checkpoint is saved with the round sampled ahead and
    the version counter, training stops, no thread left."""

    class Terminate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = trainer_for(tmp_path, server.url, callbacks=[Terminate()])
    trainer.train()
    assert trainer.state.global_step == 1 and no_generation_thread()
    saved = torch.load(tmp_path / "checkpoint-1" / ASYNC_FILE.format(0), weights_only=True)
    assert saved["version"] == 1 and [r["index"] for r in saved["rounds"]] == [1]
    assert (tmp_path / "checkpoint-1" / STATE_FILE).is_file()


# ---- Two processes ------------------------------------------------------------------------------------


def test_two_processes_sample_their_own_shares_ahead(tmp_path, server):
    """DDP over gloo: each process's thread sends its own share of each round (its seeds keyed by
    the process) from the same versions as on one process; the weights go once per version a round
    is sampled from; both processes train 4 steps and log the same staleness."""
    launch_two_processes(ROOT / "tests" / "server_worker.py", [server.url, str(tmp_path), "async"], tmp_path)
    per_round = rounds_requested(server, [0, 0, 1, 2], processes=2)
    assert [len(prompts) for prompts in per_round] == [4, 4, 4, 4]  # 2 prompts per process per round
    assert sum(path == "/collective_rpc" for path, _ in server.requests) == 3  # versions 0, 1, 2
    for index in (0, 1):
        log = json.loads((tmp_path / f"log-{index}.json").read_text())
        assert [e["sample/staleness_mean"] for e in log if "sample/staleness_mean" in e] == [0, 1, 1, 1]


def test_a_process_done_early_waits_for_a_peers_longer_episodes_in_short_collectives(tmp_path):
    """Async GRPO on 2 processes (gloo, ddp_timeout=6 s on the group from the start of training), each
    with one prompt's tool episodes: one calls `add` 4 times before answering, the other answers at
    once, and each request takes 2 s, so one process's round is ready ~8 s before the other's. It
    waits for its peer in collectives of about a second (AGREE_EVERY_S), not in one that outlasts
    ddp_timeout: both train their step."""

    def four_calls_for_one_plus_one(prompt, j, body):
        text = TOKENIZER.decode(prompt)
        if "1 + 1" in text and text.count("<|im_start|>tool") < 4:
            return tool_then_answer([], j, body)  # a call of `add`
        return TOKENIZER("done", add_special_tokens=False)["input_ids"] + [EOS]

    fake = FakeVLLMServer(EOS, four_calls_for_one_plus_one)
    fake.delay = 2.0
    try:
        launch_two_processes(
            ROOT / "tests" / "server_worker.py", [fake.url, str(tmp_path), "async-turns"], tmp_path
        )
    finally:
        fake.close()
    results = sorted(
        TOKENIZER.decode(body["prompt"]).count("<|im_start|>tool") for body in fake.completions()
    )
    assert results == [
        0,
        0,
        1,
        2,
        3,
        4,
    ]  # tool results in context: 5 turns of one episode group, 1 of the other
    assert (tmp_path / "trained-0").read_text() == (tmp_path / "trained-1").read_text() == "1"
