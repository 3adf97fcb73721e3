"""HTTP to a vLLM server: every call has a timeout and fails with an error that says what to do.

Endpoints: `/health`, `/v1/completions` (token ids in, token ids and log-probs out), and the
development ones a server exposes with `VLLM_SERVER_DEV_MODE=1`: `/server_info`,
`/collective_rpc` (reload_weights), `/reset_prefix_cache`; `/get_world_size` for NCCL.
Standard library only, so a trainer that only talks to a server needs no vLLM installed.
`abort()` ends a client's requests in flight at once (async GRPO's generation thread stops within
seconds, not after a request's timeout).
"""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

START_COMMAND = (
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model <the policy's model> "
    "--logprobs-mode processed_logprobs --port <port> (README, 'vLLM server mode')"
)


class VLLMClient:
    """The server at `base_url`; `timeout`: seconds any one request may take; `on_answer()` is called
    after each answer (async GRPO's heartbeat)."""

    def __init__(self, base_url: str, timeout: float, on_answer: Callable[[], None] | None = None):
        self.base_url, self.timeout, self.on_answer = base_url.rstrip("/"), timeout, on_answer
        self._connections: set[http.client.HTTPConnection] = set()  # open now, for `abort`
        self._lock = threading.Lock()
        self.aborted = False
        tracked = (
            _tracked(handler, self) for handler in (urllib.request.HTTPHandler, urllib.request.HTTPSHandler)
        )
        self._opener = urllib.request.build_opener(*tracked)

    def abort(self) -> None:
        """End every request in flight (it raises ConnectionError) and refuse new ones."""
        with self._lock:
            self.aborted = True
            for connection in self._connections:
                if connection.sock is not None:
                    try:
                        connection.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already closed

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """One request; the JSON answer ({} for an empty one). Raises ConnectionError (no server, or it
        went away), TimeoutError (no answer in time) or RuntimeError (the server refused)."""
        timeout = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        if self.aborted:
            raise ConnectionError(
                f"The requests of this client to {self.base_url} were aborted (the run is stopping)."
            )
        try:
            with self._opener.open(request, timeout=timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            if error.code == 404 and path != "/v1/completions":
                raise RuntimeError(
                    f"The vLLM server at {self.base_url} has no {path}: start it with VLLM_SERVER_DEV_MODE=1 "
                    f"(grpo-hf updates its weights through its development endpoints): {START_COMMAND}."
                ) from error
            raise RuntimeError(
                f"The vLLM server at {self.base_url} refused {path} ({error.code}): {detail}"
            ) from error
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            reason = error.reason if isinstance(error, urllib.error.URLError) else error
            if isinstance(reason, TimeoutError):
                raise TimeoutError(
                    f"The vLLM server at {self.base_url} did not answer {path} within {timeout:g} s "
                    "(vllm_server_request_timeout); is it overloaded or stuck? Raise the timeout or restart it."
                ) from error
            raise ConnectionError(
                f"No answer from a vLLM server at {self.base_url} to {path} ({reason}): it is not running, or "
                f"it stopped. Start one: {START_COMMAND}; check vllm_server_base_url / vllm_server_host / "
                "vllm_server_port; or set vllm_mode='colocate'."
            ) from error
        if self.on_answer is not None:
            self.on_answer()
        return json.loads(text) if text.strip() else {}

    def wait_until_up(self, total_timeout: float) -> None:
        """Poll /health until the server answers; ConnectionError after `total_timeout` seconds."""
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                self.request("GET", "/health", timeout=min(10.0, total_timeout))
                return
            except (ConnectionError, TimeoutError, RuntimeError) as error:
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"No vLLM server came up at {self.base_url} within vllm_server_timeout={total_timeout:g} s "
                        f"({error})."
                    ) from error
            time.sleep(1.0)

    def server_config(self) -> dict:
        """The server's vLLM config (model, logprobs_mode, weight transfer, ...)."""
        return self.request("GET", "/server_info?config_format=json")["vllm_config"]

    def complete(self, body: dict) -> dict:
        """POST /v1/completions."""
        return self.request("POST", "/v1/completions", body)

    def reload_weights(self, folder: str) -> None:
        """Load the safetensors weights in `folder` (a path the server sees) into the served model."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": folder}, "timeout": self.timeout}
        try:
            self.request("POST", "/collective_rpc", body)
        except RuntimeError as error:
            raise RuntimeError(
                f"The vLLM server could not load the weights written to {folder}; vllm_weight_sync_dir must be a "
                f"folder the server reads at the same path (shared storage), or use vllm_weight_sync='nccl': {error}"
            ) from error

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt prefixes (computed with the old weights)."""
        answer = self.request("POST", "/reset_prefix_cache")
        if answer.get("success") is False:
            raise RuntimeError(
                f"The vLLM server at {self.base_url} could not reset its prefix cache: {answer}."
            )

    def world_size(self) -> int:
        """The server's workers (tensor x pipeline x data parallel)."""
        return int(self.request("GET", "/get_world_size")["world_size"])


def _tracked(handler: type, client: VLLMClient) -> urllib.request.BaseHandler:
    """`handler` (urllib's HTTP or HTTPS handler) with each connection it opens registered with
    `client` until its answer has come (what follows is a read of bytes already sent), so that
    `client.abort()` can shut its socket down."""

    class Tracked(handler):
        def do_open(self, http_class, request, **kwargs):
            made = []

            def connection(*args, **kw):
                made.append(http_class(*args, **kw))
                with client._lock:
                    client._connections.add(made[-1])
                return made[-1]

            try:
                return super().do_open(connection, request, **kwargs)
            finally:
                with client._lock:
                    client._connections.difference_update(made)

    return Tracked()
