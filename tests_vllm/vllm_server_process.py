"""A real vLLM OpenAI-compatible server on localhost, as tests_vllm/ and bench/async_overlap.py start
it: SmolLM2-135M-Instruct in float32, eager, seeded, the sampler's processed log-probs, and
VLLM_SERVER_DEV_MODE=1 (the /collective_rpc weight reload)."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

KV_CACHE_BYTES = 256 * 2**20
MAX_MODEL_LEN = 768
# vllm_weight_sync='lora': adapters registered at run time, up to rank 16, two in a batch
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def model_path() -> str:
    from grpo_hf.models.loading import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def start_server(
    port: int,
    log: Path,
    timeout: float,
    prefix: list[str] = (),
    env: dict | None = None,
    lora: bool = False,
) -> subprocess.Popen:
    """The server on `port`, its output to `log`, once it answers /health; `prefix` goes before the
    command (e.g. taskset), `env` adds to the environment, `lora` lets it take LoRA adapters. A RuntimeError with the log's tail when it
    exits or does not answer within `timeout` seconds (it is stopped then)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(), "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--logprobs-mode", "processed_logprobs",
        "--enforce-eager", "--max-num-seqs", "32", "--seed", "0", *(LORA_ARGS if lora else []),
    ]  # fmt: skip
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(LORA_ENV if lora else {}), **(env or {})}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*prefix, *command], stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return process
        except OSError:
            if time.monotonic() > deadline:
                stop_server(process)
                raise RuntimeError(f"no vLLM server after {timeout} s:\n{log.read_text()[-3000:]}") from None
            time.sleep(2)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group; SIGKILL after 30 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
