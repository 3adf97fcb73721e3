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

from grpo_hf.config import GRPOConfig
from grpo_hf.config.vllm_args import VLLM_SAMPLING_KEYS
from grpo_hf.data import rollout
from grpo_hf.engine.vllm.colocate import ColocateGenerator

THREADS = 2  # torch's threads when the engine starts: not the 1 (OMP_NUM_THREADS) the tests run with


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A SmolLM2 + LoRA trainer whose engine every test of the module reuses."""
    torch.set_num_threads(THREADS)
    return make_trainer(tmp_path_factory.mktemp("colocate"), **vllm_settings())


def test_the_engine_is_in_process_and_training_keeps_its_threads(trainer):
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op: the trainer's thread count and
    that function are as they were before the engine started."""
    assert isinstance(trainer.generator, ColocateGenerator)
    assert torch.get_num_threads() == THREADS and torch.set_num_threads.__module__ == "torch"


def test_the_generation_kwargs_names_are_vllms():
    """config_generation.VLLM_SAMPLING_KEYS, written out so that the settings are checked without
    vLLM, are vLLM's SamplingParams fields that its /v1/completions request also takes."""
    from vllm import SamplingParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    fields = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
    assert fields & set(CompletionRequest.model_fields) == VLLM_SAMPLING_KEYS


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
    """generation_kwargs are SamplingParams keys with vLLM: prompts whose answer is already written
    (an EOS is likely next) have an EOS within 6 tokens in a control run, and none with the same seed
    and min_tokens=6 (vLLM's name), which keeps every completion going 6 tokens before its EOS may
    come; an unknown key is refused before the engine starts."""
    import dataclasses

    from helpers import DATASET, completions

    tokenizer, example = trainer.processing_class, DATASET[8]
    answered = rollout.render_prompt(tokenizer, example["prompt"]) + f"The answer is {example['answer']}."
    ids, mask = rollout.tokenize_prompts(tokenizer, [answered] * 8, None, torch.device("cpu"))
    eos = set(trainer.sampling.eos_token_ids)

    def early_eos(generation_kwargs: dict) -> list[bool]:
        settings = dataclasses.replace(
            trainer.sampling, generation_kwargs=generation_kwargs, max_new_tokens=8
        )
        result = trainer.generator.generate(ids, mask, settings, policy_version=300)  # this trainer's weights
        return [len(row) < 6 or bool(set(row[:6]) & eos) for row in completions(result)]

    assert any(early_eos({"seed": 0}))  # a probe before the test: 2 of the first 4 stopped at once
    assert not any(early_eos({"seed": 0, "min_tokens": 6}))
    with pytest.raises(ValueError, match="generation_kwargs.*SamplingParams"):
        make_trainer(tmp_path, **vllm_settings(generation_kwargs={"num_beams": 2}))


def test_sleep_mode_is_refused_on_a_cpu(tmp_path):
    """Item f: vLLM offers sleep mode on CUDA only; the setting is refused before any model work."""
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):
        GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], use_vllm=True, vllm_enable_sleep_mode=True
        )
