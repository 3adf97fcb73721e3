"""Colocate mode with real vLLM: one in-process engine for the module, shared by every trainer."""

import pytest
import torch
from conftest import shared_engine, vllm_settings
from helpers import (
    TOOL_CALL,
    add,
    assert_lora_run_moves_logs_and_resumes,
    assert_plain_policy_sync,
    assert_sampler_logps_match,
    assert_seeded,
    assert_sync_reaches_the_engine,
    assert_top_k_sampler_logps_are_renormalised,
    assert_two_turn_tool_episodes,
    make_trainer,
)

from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.engine.vllm.colocate import ColocateGenerator


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A SmolLM2 + LoRA trainer whose engine every test of the module reuses."""
    return make_trainer(tmp_path_factory.mktemp("colocate"), **vllm_settings())


def test_the_engine_is_in_process_and_training_keeps_its_threads(trainer):
    assert isinstance(trainer.generator, ColocateGenerator)
    assert torch.get_num_threads() >= 1 and torch.set_num_threads.__module__ == "torch"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logps_equal_our_logprob_pass(trainer, temperature):
    assert_sampler_logps_match(trainer, temperature, version=int(temperature * 10))


def test_sampler_logps_under_top_k_are_the_sampled_distributions(trainer):
    assert_top_k_sampler_logps_are_renormalised(trainer, top_k=2, version=3)


def test_runs_are_reproducible(trainer):
    assert_seeded(trainer)


def test_lora_sync_reaches_the_engine(trainer):
    assert_sync_reaches_the_engine(trainer, trainer.model, names=("lora_B",))


@pytest.mark.parametrize("names", [("layers.3.mlp", "layers.10.self_attn"), ("embed_tokens",)])
def test_full_fine_tuning_sync_reaches_the_engine(trainer, names):
    """Every weight is sent; SmolLM2 ties its LM head to the embedding, so a trained embedding must
    reach the head too (on a CPU vLLM's reload leaves the head's packed matrix alone: the generator
    re-packs it)."""
    assert_plain_policy_sync(trainer, names)


def test_lora_training_moves_logs_and_resumes(trainer, tmp_path):
    """Item c through the module's engine."""
    with shared_engine(trainer.generator):
        assert_lora_run_moves_logs_and_resumes(tmp_path, vllm_settings())


def test_two_turn_tool_episode(trainer, tmp_path):
    """Item e: the first turn is forced (vllm_structured_outputs_regex) to call the tool; its result
    enters the context; the second turn is generated after it; tool tokens are out of the loss."""
    settings = vllm_settings(
        vllm_structured_outputs_regex=TOOL_CALL, max_tool_calling_iterations=1, max_completion_length=160
    )
    with shared_engine(trainer.generator):
        run = make_trainer(tmp_path, tools=[add], **settings)
        scored = run._sample_and_score([run.train_dataset[0]] * 2)
    assert_two_turn_tool_episodes(scored)


def test_generation_kwargs_reach_vllm_and_are_checked(trainer, tmp_path):
    """generation_kwargs are SamplingParams keys with vLLM: min_tokens=6 (vLLM's name) keeps every
    completion going 6 tokens before its EOS may come; an unknown key is refused before the engine
    starts."""
    import dataclasses

    from helpers import completions, prompts

    ids, mask = prompts(trainer, [8, 8, 9, 9])
    settings = dataclasses.replace(trainer.sampling, generation_kwargs={"min_tokens": 6}, max_new_tokens=8)
    rows = completions(
        trainer.generator.generate(ids, mask, settings, policy_version=trainer.generator.version)
    )
    eos = trainer.sampling.eos_token_ids
    assert all(len(row) >= 6 and not set(row[:6]) & set(eos) for row in rows)
    with pytest.raises(ValueError, match="generation_kwargs.*SamplingParams"):
        make_trainer(tmp_path, **vllm_settings(generation_kwargs={"num_beams": 2}))


def test_sleep_mode_is_refused_on_a_cpu(tmp_path):
    """Item f: vLLM offers sleep mode on CUDA only; the setting is refused before any model work."""
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):
        GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], use_vllm=True, vllm_enable_sleep_mode=True
        )
