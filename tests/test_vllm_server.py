"""Server mode without vLLM: `engine.vllm` against `fake_vllm_server.FakeVLLMServer` (the same HTTP
endpoints), the pure request planning both vLLM modes share, and where colocate's engine starts
from. The real server is exercised by tests_vllm/ (run with the vLLM environment)."""

import importlib.util
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from fake_vllm_server import FakeVLLMServer
from huggingface_hub.utils import filter_repo_objects
from peft import LoraConfig
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import (
    BEST_MODEL_SETTINGS,
    BestAtStep,
    chat_dataset,
    free_port,
    length_reward,
    make_config,
)
from two_processes import launch_two_processes

from grpo_hf import GRPOTrainer
from grpo_hf.engine.generation import Sampling
from grpo_hf.engine.generation_copy import policy_weights
from grpo_hf.engine.vllm.client import VLLMClient
from grpo_hf.engine.vllm.colocate import model_source
from grpo_hf.engine.vllm.requests import plan_prompts, request_seed, rollout_from_samples, sampling_fields
from grpo_hf.engine.vllm.server import ServerGenerator
from grpo_hf.engine.vllm.weights import FileWeights, adapter_name, within
from grpo_hf.training.checkpoints import STATE_FILE

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


@pytest.fixture
def server():
    fake = FakeVLLMServer(EOS)
    yield fake
    fake.close()


def server_trainer(tmp_path, url: str, peft_config=None, eval_dataset=None, callbacks=None, **overrides):
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=5.0)
    return GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=length_reward,
        args=make_config(tmp_path, **(settings | overrides)),
        train_dataset=chat_dataset(),
        eval_dataset=eval_dataset,
        processing_class=TOKENIZER,
        peft_config=peft_config or LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=callbacks,
    )


# ---- Requests: pure functions -------------------------------------------------------------------------


def test_each_distinct_prompt_is_one_request_and_rows_get_its_samples_in_order():
    rows = [[1, 2], [1, 2], [3], [1, 2], [3]]
    prompts, counts, slots = plan_prompts(rows)
    assert prompts == [[1, 2], [3]] and counts == [3, 2]
    assert slots == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]  # row 3 takes sample 2 of prompt 0


def test_request_seeds_are_reproducible_and_distinct():
    seeds = {
        request_seed(0, version, call, key) for version in range(3) for call in range(3) for key in range(20)
    }
    assert len(seeds) == 180 and all(0 <= s < 2**48 for s in seeds)
    assert request_seed(0, 1, 2, 3) == request_seed(0, 1, 2, 3) != request_seed(1, 1, 2, 3)


def test_sampling_fields_are_explicit_and_generation_kwargs_override_them():
    sampling = Sampling(8, 0.7, 0, 0.9, None, 1.1, [2, 5], 0, {"top_k": 20, "presence_penalty": 0.5})
    fields = sampling_fields(sampling, n=4, seed=11, regex=r"\d+")
    assert fields == {
        "n": 4, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.0, "logprobs": 0, "seed": 11,
        "stop_token_ids": [2, 5], "skip_special_tokens": False, "structured_outputs": {"regex": r"\d+"},
    }  # fmt: skip
    with pytest.raises(ValueError, match="num_generations"):
        sampling_fields(Sampling(8, 1.0, 0, 1.0, None, 1.0, [2], 0, {"n": 2}), 1, 0, None)


@pytest.mark.parametrize("pad", [0, 2], ids=["pad_0", "pad_is_eos"])
def test_rollout_from_samples_cuts_after_eos(pad):
    """eos 2: row 0 stops at its EOS (what follows is dropped), row 1 ended without EOS (a regex done)
    and is shorter, row 2 reached max_tokens."""
    samples = [([5, 2, 7], [-0.1, -0.2, -0.3]), ([6], [-0.5]), ([8, 9, 4], [-1.0, -2.0, -3.0])]
    ids = torch.zeros((3, 1), dtype=torch.long)
    result = rollout_from_samples(
        ids, torch.ones_like(ids), samples, Sampling(3, 1.0, 0, 1.0, None, 1.0, [2], pad)
    )
    assert result.completion_ids.tolist() == [[5, 2, pad], [6, pad, pad], [8, 9, 4]]
    assert result.completion_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert result.truncated.tolist() == [False, True, True]
    expected = torch.tensor([[-0.1, -0.2, 0.0], [-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]])
    torch.testing.assert_close(result.sampler_logps, expected)


# ---- HTTP: timeouts and clear errors ------------------------------------------------------------------


def test_no_server_is_a_connection_error_that_says_how_to_start_one():
    client = VLLMClient(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    with pytest.raises(
        ConnectionError, match="VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server"
    ):
        client.complete({"prompt": [1]})
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="within vllm_server_timeout=1 s"):
        client.wait_until_up(1.0)
    assert time.monotonic() - start < 5


def test_a_url_that_is_not_a_servers_root_fails_at_once(server):
    """A URL with /v1 after the root gets HTTP 404 from /health: something is up there, so an error
    about the URL within seconds, not vllm_server_timeout's wait and a hint to start a server. An
    HTTP 503 (up, not ready) is waited on."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"vllm_server_base_url .*without a path such as /v1"):
        VLLMClient(server.url + "/v1", timeout=2.0).wait_until_up(30.0)
    assert time.monotonic() - start < 5
    server.health_status = 503
    with pytest.raises(ConnectionError, match="not ready within vllm_server_timeout=1 s"):
        VLLMClient(server.url, timeout=2.0).wait_until_up(1.0)


def test_a_server_on_this_machine_is_reached_past_an_http_proxy(server, monkeypatch):
    """urllib sends requests through http_proxy (here a dead port, no no_proxy): a server on this
    machine is reached directly."""
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, dead)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen reads the environment again
    port = server.url.rsplit(":", 1)[1]
    for host in ("127.0.0.1", "localhost"):
        VLLMClient(f"http://{host}:{port}", timeout=2.0).request("GET", "/health")  # no ConnectionError


def test_a_generation_round_is_bounded_as_a_whole(server):
    """The round's requests together take at most vllm_server_request_timeout: four 1 s requests one
    at a time against a 2.5 s timeout stop after it, though each alone answers in time."""
    server.delay = 1.0
    bodies = [{"prompt": [k], "n": 1, "max_tokens": 2, "seed": 0} for k in range(4)]
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match="generation round's 4 requests within vllm_server_request_timeout"
    ):
        VLLMClient(server.url, timeout=2.5).complete_all(bodies, concurrency=1)
    assert time.monotonic() - start < 3.5
    assert len(VLLMClient(server.url, timeout=2.5).complete_all(bodies[:2], concurrency=1)) == 2


class Interrupted(BaseException):
    """Not an Exception, as KeyboardInterrupt or asyncio.CancelledError."""


def test_an_nccl_wait_is_given_up_after_the_request_timeout():
    """NcclWeights runs its rendezvous and transfers through `within` (NCCL itself cannot run here): a
    call that never returns (workers that never join) is a TimeoutError naming the setting; an
    error is re-raised, a BaseException too (not lost with its thread, the transfer passing for done)."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="vllm_server_request_timeout=0.5 s"):
        within(0.5, threading.Event().wait, "The NCCL weight transfer")
    assert time.monotonic() - start < 2
    with pytest.raises(KeyError, match="missing"):
        within(5.0, lambda: {}["missing"], "A lookup")

    def interrupted() -> None:
        raise Interrupted("the transfer was interrupted")

    with pytest.raises(Interrupted, match="interrupted"):
        within(5.0, interrupted, "The NCCL weight transfer")


def test_a_slow_server_is_a_timeout_and_a_dead_one_a_connection_error(server):
    client = VLLMClient(server.url, timeout=0.5)
    server.delay = 3.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="vllm_server_request_timeout"):
        client.complete({"prompt": [1], "n": 1, "max_tokens": 2, "seed": 0})
    assert time.monotonic() - start < 2.5
    server.delay, server.die_after = 0.0, 0
    with pytest.raises(ConnectionError, match="it stopped"):
        client.complete({"prompt": [1], "n": 1, "max_tokens": 2, "seed": 0})


def test_abort_ends_the_requests_in_flight_at_once_and_refuses_new_ones(server):
    """A request waiting on a slow server (5 s) ends within a second of `abort`, as a ConnectionError."""
    client, body = VLLMClient(server.url, timeout=30.0), {"prompt": [1], "n": 1, "max_tokens": 2, "seed": 0}
    server.delay = 5.0
    outcome = []

    def request():
        try:
            client.complete(body)
        except Exception as error:
            outcome.append(error)

    waiting = threading.Thread(target=request)
    waiting.start()
    time.sleep(0.5)  # the request is in flight
    start = time.monotonic()
    client.abort()
    waiting.join(timeout=5.0)
    assert not waiting.is_alive() and time.monotonic() - start < 1.0
    assert isinstance(outcome[0], ConnectionError)
    with pytest.raises(ConnectionError, match="aborted"):
        client.complete(body)


def test_an_abort_while_a_connection_opens_ends_its_request_too(server, monkeypatch):
    """`abort` landing while a request's connection is being made (no socket yet to shut down, or
    just after the request checked `aborted`) ends that request at once too, instead of leaving it to
    wait for the server (5 s here; a stopping run waited 30 s for its generation thread)."""
    client, body = VLLMClient(server.url, timeout=30.0), {"prompt": [1], "n": 1, "max_tokens": 2, "seed": 0}
    server.delay = 5.0
    connect = socket.create_connection

    def abort_then_connect(*args, **kwargs):
        client.abort()
        return connect(*args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", abort_then_connect)
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        client.complete(body)
    assert time.monotonic() - start < 2.5


def test_a_server_without_dev_mode_or_with_raw_logprobs_is_refused(tmp_path, server):
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        VLLMClient(server.url, timeout=2.0).request("POST", "/not_there")
    server.logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        server_trainer(tmp_path, server.url)


def test_auto_weight_sync_without_vllm_here_sends_files(tmp_path, server, monkeypatch, caplog):
    """A CUDA trainer and a server offering NCCL, but no vLLM on the trainer's side (server mode needs
    none): 'auto' sends files and says which setting chooses, instead of a ModuleNotFoundError."""
    args = make_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
    server.weight_transfer_config = {"backend": "nccl"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    generator = ServerGenerator(args.generation_settings(), Accelerator(cpu=True), None, None)
    assert isinstance(generator.sender, FileWeights)
    assert "vllm_weight_sync='files'" in caplog.text


# ---- Colocate: where the engine starts from (no vLLM needed) ------------------------------------------


def test_a_model_without_a_checkpoint_is_copied_out_of_the_upload(tmp_path, monkeypatch):
    """A model built from a config has no checkpoint (name_or_path ''): the engine starts from a copy
    in <output_dir>/_vllm-model, which push_to_hub leaves out, even with a stray config.json in the
    current directory."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "out"
    source = model_source(make_config(output).vllm_settings(), Accelerator(cpu=True), tiny_llama(), TOKENIZER)
    assert source == {"model": str(output / "_vllm-model"), "trust_remote_code": False}
    assert (output / "_vllm-model" / "config.json").is_file()
    files = [str(p.relative_to(output)) for p in output.rglob("*") if p.is_file()]
    assert files and not list(filter_repo_objects(files, ignore_patterns=["_*", "checkpoint-*"]))


def test_a_hub_model_starts_at_its_revision_with_its_remote_code(tmp_path):
    model = tiny_llama()
    model.name_or_path = "someone/tiny-llama"  # not a folder here: a hub id
    args = make_config(tmp_path, model_init_kwargs={"revision": "v2"}, trust_remote_code=True)
    assert model_source(args.vllm_settings(), Accelerator(cpu=True), model, TOKENIZER) == {
        "model": "someone/tiny-llama", "revision": "v2", "tokenizer_revision": "v2", "trust_remote_code": True,
    }  # fmt: skip


# ---- Training through a server ------------------------------------------------------------------------


def test_lora_training_through_a_server(tmp_path, server):
    """Per round: weights (LoRA merged, plain names) sent once, then the prefix cache reset; each
    distinct prompt one request with n = its rows, every request its own seed; the parameters move."""
    trainer = server_trainer(tmp_path, server.url, max_steps=2, logging_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    paths = [path for path, _ in server.requests if path in ("/collective_rpc", "/reset_prefix_cache")]
    assert paths == ["/collective_rpc", "/reset_prefix_cache"] * 2  # one update per optimizer step
    first, second = server.loaded
    expected = set(dict(policy_weights(trainer.model)))
    assert set(first) == expected and not any("lora" in n or "base_layer" in n for n in first)
    q, mlp = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(first[q], second[q]) and torch.equal(
        first[mlp], second[mlp]
    )  # LoRA merged in q only
    assert os.listdir(tmp_path / "_vllm-weights") == []  # each update gone after the next, the last at end
    bodies = server.completions()
    assert [body["n"] for body in bodies] == [4, 4, 4, 4]  # 2 prompts x G = 4 per round, 2 rounds
    assert len({body["seed"] for body in bodies}) == 4
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
    logged = trainer.state.log_history[0]
    assert logged["sampler/ratio_mean"] > 0 and "reward" in logged


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_staleness=0, **BEST_MODEL_SETTINGS),
        dict(max_staleness=1, **BEST_MODEL_SETTINGS),
        dict(max_staleness=1, weight_sync_steps=2),
    ],
    ids=["sync-best-model", "async-best-model", "async-last-step-not-synced"],
)
def test_evaluate_after_train_samples_from_the_model_it_scores(tmp_path, server, settings):
    """Weights that change with no new step reach the server before evaluate() samples: the best
    model (checkpoint-2) that load_best_model_at_end loads after step 3, synchronous or async; and in
    async GRPO syncing every 2 steps, step 3's weights, which no sync sent."""
    trainer = server_trainer(
        tmp_path, server.url, max_steps=3, eval_dataset=chat_dataset(2), callbacks=[BestAtStep(2)], **settings
    )
    trainer.train()
    reloads = len(server.loaded)
    trainer.evaluate()
    assert len(server.loaded) == reloads + 1
    served, model = server.loaded[-1], dict(policy_weights(trainer.model))
    assert set(served) == set(model) and all(torch.equal(served[n], model[n]) for n in model)


def adapter_tensors(trainer) -> dict[str, torch.Tensor]:
    """The policy's LoRA tensors under PEFT's saved names (as adapter_model.safetensors holds them)."""
    return {
        name.replace(".default", ""): param.detach().clone()
        for name, param in trainer.model.named_parameters()
        if "lora_" in name
    }


LORA_SERVER = {"max_lora_rank": 16, "max_loras": 2}  # /server_info's lora_config under --enable-lora


@pytest.mark.parametrize(("staleness", "mode"), [(0, "auto"), (1, "lora")], ids=["sync-auto", "async"])
def test_lora_weight_sync_sends_the_adapter_alone(tmp_path, server, staleness, mode):
    """vllm_weight_sync='lora', and 'auto' with a server started with --enable-lora: each policy
    version's adapter (only LoRA tensors, equal to the policy's when sent) is registered as its own
    model and the rounds of that version name it; no merged weights go; each is unloaded with its
    folder once the next is registered, and when training ends none is left (registered or on disk)."""
    server.lora_config = LORA_SERVER
    trainer = server_trainer(
        tmp_path, server.url, max_steps=4, vllm_weight_sync=mode, max_staleness=staleness
    )
    sent = []
    original = trainer.generator.load_policy

    def load_policy(version):
        sent.append(adapter_tensors(trainer))
        original(version)

    trainer.generator.load_policy = load_policy
    trainer.train()
    names = [name for name, _ in server.adapter_loads]
    run = trainer.generator.run
    # Synchronous: a version per step. Async: the last step's version samples no round, so it is not sent.
    expected = 4 if staleness == 0 else 3
    assert names == [adapter_name(run, v) for v in range(len(names))] and len(names) == expected
    for (_, tensors), policy in zip(server.adapter_loads, sent, strict=True):
        assert set(tensors) == set(policy) and all(torch.equal(tensors[n], policy[n]) for n in policy)
    assert not torch.equal(
        sent[0][next(n for n in sent[0] if "lora_B" in n)],
        sent[-1][next(n for n in sent[-1] if "lora_B" in n)],
    )
    assert not any(path == "/collective_rpc" for path, _ in server.requests)
    models = [body["model"] for body in server.completions()]
    rounds_from = [0, 1, 2, 3] if staleness == 0 else [0, 0, 1, 2]  # each round's version
    assert sorted(set(models)) == [adapter_name(run, v) for v in sorted(set(rounds_from))]
    unloads = [body["lora_name"] for path, body in server.requests if path == "/v1/unload_lora_adapter"]
    assert unloads == names and server.adapters == {}  # each after the next is in, the last at the end
    assert os.listdir(tmp_path / "_vllm-weights") == []


def test_lora_weight_sync_refuses_what_vllm_cannot_serve(tmp_path, server):
    with pytest.raises(ValueError, match="started without --enable-lora.*--max-lora-rank"):
        server_trainer(tmp_path, server.url, vllm_weight_sync="lora")
    server.lora_config = {"max_lora_rank": 8, "max_loras": 2}
    with pytest.raises(ValueError, match="rank 16 above the server's --max-lora-rank 8"):
        server_trainer(
            tmp_path,
            server.url,
            vllm_weight_sync="lora",
            peft_config=LoraConfig(r=16, target_modules=["q_proj"]),
        )
    with pytest.raises(ValueError, match="vllm_weight_sync='lora'.*no PEFT LoRA adapter.*'files'"):
        GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
                             vllm_server_timeout=5.0, vllm_weight_sync="lora"),
            train_dataset=chat_dataset(),
            processing_class=TOKENIZER,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"modules_to_save=\['lm_head'\]"):
        server_trainer(
            tmp_path,
            server.url,
            vllm_weight_sync="lora",
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        )
    with pytest.raises(ValueError, match="vllm_weight_sync='lora'.*vllm_mode='server'"):
        make_config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_weight_sync="lora")


def test_auto_sends_merged_weights_for_an_adapter_vllm_cannot_serve(tmp_path, server, caplog):
    server.lora_config = LORA_SERVER
    peft_config = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.engine.vllm.server"):
        trainer = server_trainer(tmp_path, server.url, max_steps=1, peft_config=peft_config)
    assert "merged weights go instead" in caplog.text and "use_dora=True" in caplog.text
    trainer.train()
    assert [path for path, _ in server.requests].count("/collective_rpc") == 1 and not server.adapter_loads


def test_a_server_without_runtime_lora_loading_is_named(tmp_path, server):
    server.lora_config = LORA_SERVER
    server.lora_routes = False
    trainer = server_trainer(tmp_path, server.url, max_steps=1, vllm_weight_sync="lora")
    with pytest.raises(RuntimeError, match="--enable-lora.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        trainer.train()


def test_two_runs_on_one_server_keep_their_own_adapters(tmp_path, server):
    """Two LoRA runs of one run_name (other seeds: other adapters) take turns on one server that
    takes adapters: each run's requests name its own adapter (the run_name, then the run's random
    part), which holds its own tensors, and one run ending unloads none of the other's."""
    server.lora_config = LORA_SERVER
    runs = [
        server_trainer(tmp_path / name, server.url, vllm_weight_sync="lora", seed=seed, run_name="sweep 7/lr")
        for name, seed in (("a", 0), ("b", 1))
    ]
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    named = []  # (run, the model its request named)
    for run in (0, 1, 0):
        runs[run].generate_completions(ids, torch.ones_like(ids))
        named.append((run, server.completions()[-1]["model"]))
    assert named[0] == named[2] and named[0][1] != named[1][1]
    assert all(re.fullmatch(r"grpo-hf-sweep-7-lr-[0-9a-f]{8}-v0", model) for _, model in named)
    for run, model in named:
        assert set(server.adapters[model]) == set(adapter_tensors(runs[run]))
        assert all(torch.equal(server.adapters[model][n], v) for n, v in adapter_tensors(runs[run]).items())
    runs[1].generator.close()
    assert list(server.adapters) == [named[0][1]]


def test_an_adapter_name_the_server_holds_already_is_replaced(tmp_path, server):
    """A run resumed against the same server sends version v again: the old v is unloaded first."""
    client = VLLMClient(server.url, 5.0)
    folder = tmp_path / "a"
    folder.mkdir()
    from safetensors.torch import save_file

    for value in (1.0, 2.0):
        save_file({"w": torch.full((2,), value)}, str(folder / "adapter_model.safetensors"))
        client.load_lora_adapter("x", str(folder))
    assert server.adapters["x"]["w"].tolist() == [2.0, 2.0] and len(server.adapter_loads) == 2


def test_push_to_hub_uploads_no_weight_file_and_no_completion_log(tmp_path, server):
    """What a LoRA run against a server leaves in output_dir, while it runs (weights loaded by the
    server, checkpoints) and after it (the adapter saved), filtered as Trainer.push_to_hub and
    _push_from_checkpoint filter it (transformers 5.24: ignore_patterns=["_*", "checkpoint-*"]): no
    vLLM weight file and no completion log; the logs stay on disk; the last weight file is gone."""
    ignore = ["_*", "checkpoint-*"]
    trainer = server_trainer(
        tmp_path, server.url, max_steps=2, log_completions=True, save_strategy="steps", save_steps=1
    )
    trainer.train()
    trainer.save_model()
    files = [str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file()]
    weights = [
        str(Path(body["kwargs"]["weights_path"], "model.safetensors").relative_to(tmp_path))
        for path, body in server.requests
        if path == "/collective_rpc"
    ]
    logs = [name for name in files if name.endswith(".parquet")]
    assert len(weights) == 2 and len(logs) == 2  # two updates, two logged steps
    uploaded = list(filter_repo_objects(files + weights, ignore_patterns=ignore))
    assert "adapter_model.safetensors" in uploaded
    assert not [name for name in uploaded if "vllm" in name or name.endswith(".parquet")], uploaded
    assert os.listdir(tmp_path / "_vllm-weights") == []


def test_a_weight_file_the_server_could_not_load_is_removed(tmp_path, server):
    sender = FileWeights(VLLMClient(server.url, 2.0), str(tmp_path / "weights"), torch.float32)
    sender.send(iter([("w", torch.ones(2))]))
    server.refuse_reload = True
    with pytest.raises(RuntimeError, match="could not load the weights"):
        sender.send(iter([("w", torch.zeros(2))]))
    assert os.listdir(tmp_path / "weights") == ["update-1"]  # the weights the server holds
    sender.close()
    assert os.listdir(tmp_path / "weights") == []


def test_a_server_dying_mid_run_stops_with_a_clear_error_and_the_run_resumes(tmp_path, server):
    """The server answers the first round and dies in the second: a ConnectionError, no hang, the
    checkpoint of step 1 complete; a new server and resume_from_checkpoint=True finish the run."""
    server.die_after = 2  # two requests (2 prompts) per round
    trainer = server_trainer(tmp_path, server.url, max_steps=2, save_strategy="steps", save_steps=1)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="it stopped"):
        trainer.train()
    assert time.monotonic() - start < 60
    assert (tmp_path / "checkpoint-1" / STATE_FILE).is_file()
    second = FakeVLLMServer(EOS)
    try:
        resumed = server_trainer(tmp_path, second.url, max_steps=2, save_strategy="steps", save_steps=1)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 2 and len(second.loaded) == 1
    finally:
        second.close()


def test_a_two_turn_tool_episode_through_a_server(tmp_path):
    """Turn 1 calls the tool, turn 2 answers: two rounds of requests, the second with the tool's
    result in every context, which is masked out of the loss."""

    def completion(prompt, j, body):
        answered = "<|im_start|>tool" in TOKENIZER.decode(prompt)
        text = "done" if answered else '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        return TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]

    def add(a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    fake = FakeVLLMServer(EOS, completion)
    try:
        settings = dict(
            use_vllm=True, vllm_mode="server", vllm_server_base_url=fake.url, max_completion_length=128
        )
        trainer = GRPOTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path, **settings),
            train_dataset=chat_dataset(),
            processing_class=TOKENIZER,
            tools=[add],
        )
        scored = trainer._sample_and_score([trainer.train_dataset[i] for i in (0, 0, 1, 1)])
    finally:
        fake.close()
    turns = [TOKENIZER.decode(body["prompt"]) for body in fake.completions()]
    assert len(turns) == 4 and sum("<|im_start|>tool" in t for t in turns) == 2  # 2 prompts x 2 turns
    assert [m["role"] for m in scored.completions[0]] == ["assistant", "tool", "assistant"]
    assert scored.completions[0][1]["content"] == "3"
    assert scored.result.tool_mask.sum(dim=1).min() > 0  # every row holds tool-result tokens


def test_two_processes_share_a_server_with_different_numbers_of_turns(tmp_path):
    """Process 0's episodes take two turns, process 1's one: process 1 joins the second turn with no
    rows, and each process gets back its own rows (by the counts gathered, not rank x length)."""

    def completion(prompt, j, body):
        text = TOKENIZER.decode(prompt)
        first_two = "What is 0 + 0" in text or "What is 1 + 1" in text
        answer = "done" if "<|im_start|>tool" in text or not first_two else None
        answer = answer or '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        return TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [EOS]

    fake = FakeVLLMServer(EOS, completion)
    try:
        launch_two_processes(
            ROOT / "tests" / "server_worker.py", [fake.url, str(tmp_path), "tools"], tmp_path
        )
        first_round = [TOKENIZER.decode(body["prompt"]) for body in fake.completions()[:6]]
    finally:
        fake.close()
    zero = json.loads((tmp_path / "process-0.json").read_text())
    one = json.loads((tmp_path / "process-1.json").read_text())
    assert [[m["role"] for m in c] for c in zero] == [["assistant", "tool", "assistant"]] * 4
    assert [[m["role"] for m in c] for c in one] == [["assistant"]] * 4
    assert [sum("<|im_start|>tool" in t for t in first_round[:4]), len(first_round)] == [
        0,
        6,
    ]  # 4 + 2 requests
    assert all(
        "What is 0 + 0" in t or "What is 1 + 1" in t for t in first_round[4:]
    )  # turn 2: process 0's rows
    assert (tmp_path / "trained-0").read_text() == (tmp_path / "trained-1").read_text() == "1"


def test_a_rollout_func_may_call_the_server_a_different_number_of_times_per_process(tmp_path, server):
    """Process 0's rollout_func samples twice, process 1's once: process 1 joins the second call with
    no rows instead of the run crashing on mismatched collectives. In the first call process 0 asks
    for 2 tokens and process 1 for 128: the server samples up to 128 (fake server: sample j has j + 1
    tokens then EOS) and only process 0's completions are cut to 2."""
    launch_two_processes(ROOT / "tests" / "server_worker.py", [server.url, str(tmp_path), "uneven"], tmp_path)
    zero = json.loads((tmp_path / "calls-0.json").read_text())
    one = json.loads((tmp_path / "calls-1.json").read_text())
    assert len(zero) == 2 and len(one) == 1
    assert max(zero[0]) == 2 and max(one[0]) >= 3  # cut to 2 / the j = 1 samples: 2 tokens + EOS
    bodies = server.completions()
    first_round = 4  # 2 prompts per process
    assert [body["max_tokens"] for body in bodies[:first_round]] == [128] * first_round
    assert len(bodies) == first_round + 2  # the second call: process 0's 2 prompts only


@pytest.mark.parametrize("config", ["cpu_fsdp2.yaml", "cpu_zero3.yaml"], ids=["fsdp2", "zero3"])
def test_sharded_weights_reach_the_server_whole(tmp_path, server, config):
    """Full fine-tuning on 2 processes under FSDP2 / ZeRO-3: the first update the server loads is the
    whole initial model (gathered from the shards: every name, full shapes, the exact values); the
    second, after an optimizer step, has moved."""
    launch_two_processes(
        ROOT / "tests" / "server_worker.py", [server.url, str(tmp_path), "full"], tmp_path, config=config
    )
    first, second = server.loaded
    initial = dict(tiny_llama().named_parameters())
    assert set(first) == set(initial)
    for name, value in initial.items():
        assert torch.equal(first[name], value.detach()), name
    assert any(not torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("config", ["cpu_fsdp2.yaml", "cpu_zero3.yaml"], ids=["fsdp2", "zero3"])
def test_sharded_lora_policies_send_their_whole_adapter(tmp_path, server, config):
    """A LoRA policy on 2 processes under FSDP2 / ZeRO-3, against a server that takes adapters
    (vllm_weight_sync='auto' chooses the adapter): each step's adapter reaches the server whole, the
    first equal to the initial adapter (the same seed on one process), the second moved."""
    server.lora_config = LORA_SERVER
    launch_two_processes(
        ROOT / "tests" / "server_worker.py", [server.url, str(tmp_path), "lora"], tmp_path, config=config
    )
    names = [name for name, _ in server.adapter_loads]  # the run's identity, drawn by process 0
    assert names == [names[0].removesuffix("-v0") + suffix for suffix in ("-v0", "-v1")]
    assert not any(path == "/collective_rpc" for path, _ in server.requests)  # no merged weights
    (_, first), (_, second) = server.adapter_loads
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])  # the worker's
    initial = adapter_tensors(server_trainer(tmp_path / "one", server.url, peft_config=lora))
    assert set(first) == set(initial)
    for name, value in initial.items():
        assert torch.equal(first[name], value), name
    assert any(not torch.equal(first[name], second[name]) for name in first)


def test_dynamic_sampling_extra_rounds_go_to_the_server_with_the_rounds_weights(tmp_path, server):
    """A reward that is flat for every prompt but "1 + 1" leaves groups that teach nothing: extra
    rounds are sampled through the server, with the weights of the round's first call (one update)."""

    def flat_unless_one(completions, prompts, **kwargs):
        return [
            len(c[0]["content"]) / 10 if "1 + 1" in p[-1]["content"] else 1.0
            for c, p in zip(completions, prompts, strict=True)
        ]

    trainer = GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=flat_unless_one,
        args=make_config(
            tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, max_steps=1,
            dynamic_sampling=True, max_dynamic_sampling_rounds=2,
        ),
        train_dataset=chat_dataset(),
        processing_class=TOKENIZER,
    )  # fmt: skip
    trainer.train()
    assert len(server.loaded) == 1 and len(server.completions()) > 2  # the first round had 2 prompts
    assert trainer.state.log_history[0]["dynamic_sampling/extra_rounds"] >= 1


def test_a_server_dying_under_two_processes_stops_both(tmp_path, server):
    """Process 0 meets the dead server; the error reaches process 1 too (no process left waiting)."""
    server.die_after = 4  # the first round's 4 prompts; the second round finds the server gone
    start = time.monotonic()
    out = launch_two_processes(
        ROOT / "tests" / "server_worker.py", [server.url, str(tmp_path), "full"], tmp_path, check=False
    )
    assert time.monotonic() - start < 200
    assert "[rank0]: ConnectionError: No answer from a vLLM server" in out
    assert "[rank1]: ConnectionError: (from process 0) ConnectionError: No answer" in out
