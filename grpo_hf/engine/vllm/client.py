"""HTTP to a vLLM server: every call has a timeout and fails with an error that says what to do.

Endpoints: `/health`, `/v1/completions` (token ids in, token ids and log-probs out), and the
development ones a server exposes with `VLLM_SERVER_DEV_MODE=1`: `/server_info`,
`/collective_rpc` (reload_weights), `/reset_prefix_cache`; `/get_world_size` for NCCL.
Standard library only, so a trainer that only talks to a server needs no vLLM installed. urllib
sends requests through `http_proxy` / `https_proxy` unless `no_proxy` lists the host; a server on
this machine (localhost, 127.0.0.1, ::1, 0.0.0.0) is always reached directly. `abort()` ends a
client's requests in flight at once (async GRPO's generation thread stops within seconds, not after
a request's timeout).
"""

import http.client
import ipaddress
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

START_COMMAND = (
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model <the policy's model> "
    "--logprobs-mode processed_logprobs --port <port> (docs/vllm.md, 'Server')"
)


class ServerAnswer(RuntimeError):
    """The server answered with an HTTP error `status` (it is up, and refused the request)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class VLLMClient:
    """The server at `base_url`; `timeout`: seconds any one request may take; `on_answer()` is called
    after each answer (async GRPO's heartbeat)."""

    def __init__(self, base_url: str, timeout: float, on_answer: Callable[[], None] | None = None):
        self.base_url, self.timeout, self.on_answer = base_url.rstrip("/"), timeout, on_answer
        self._connections: set[http.client.HTTPConnection] = set()  # open now, for `abort`
        self._lock = threading.Lock()
        self.aborted = False
        handlers = [
            _tracked(handler, self) for handler in (urllib.request.HTTPHandler, urllib.request.HTTPSHandler)
        ]
        if _on_this_machine(urllib.parse.urlparse(self.base_url).hostname):
            handlers.append(urllib.request.ProxyHandler({}))  # no http_proxy for a local server
        self._opener = urllib.request.build_opener(*handlers)

    def abort(self) -> None:
        """End every request in flight (it raises ConnectionError) and refuse new ones."""
        with self._lock:
            self.aborted = True
            for connection in self._connections:
                _shut_down(connection)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """One request; the JSON answer ({} for an empty one, {"text": ...} for plain text). Raises ConnectionError (no server, or it
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
            if error.code == 404 and path not in ("/v1/completions", "/health"):
                raise ServerAnswer(
                    f"The vLLM server at {self.base_url} has no {path}: start it with VLLM_SERVER_DEV_MODE=1 "
                    f"(grpo-hf updates its weights through its development endpoints): {START_COMMAND}.",
                    error.code,
                ) from error
            raise ServerAnswer(
                f"The vLLM server at {self.base_url} refused {path} ({error.code}): {detail}", error.code
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
        if not text.strip():
            return {}
        return json.loads(text) if text.lstrip()[0] in "{[" else {"text": text}  # LoRA endpoints answer text

    def wait_until_up(self, total_timeout: float) -> None:
        """Poll /health until the server answers; ConnectionError after `total_timeout` seconds. An
        HTTP 5xx (a server, or a proxy in front of one, not ready yet) is waited on like no answer;
        another error status (404: a URL with a path such as /v1) is a ValueError at once."""
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                self.request("GET", "/health", timeout=min(10.0, total_timeout))
                return
            except ServerAnswer as error:
                if error.status < 500:
                    raise ValueError(
                        f"{self.base_url}/health answered HTTP {error.status}: something is up at {self.base_url}, "
                        "but it is not a vLLM server's root URL. Set vllm_server_base_url (or vllm_server_host / "
                        "vllm_server_port) to the server's root, without a path such as /v1 (e.g. "
                        "'http://localhost:8000')."
                    ) from error
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"The vLLM server at {self.base_url} was not ready within vllm_server_timeout="
                        f"{total_timeout:g} s ({error})."
                    ) from error
            except (ConnectionError, TimeoutError) as error:
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

    def complete_all(self, bodies: list[dict], concurrency: int = 32) -> list[dict]:
        """POST each body to /v1/completions, `concurrency` at a time, all of them within `timeout`
        seconds (a generation round: the other training processes wait for it in a collective)."""
        deadline = time.monotonic() + self.timeout

        def complete(body: dict) -> dict:
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                return self.request("POST", "/v1/completions", body, timeout=left)
            except TimeoutError as error:
                raise TimeoutError(
                    f"The vLLM server at {self.base_url} did not answer a generation round's {len(bodies)} "
                    f"requests within vllm_server_request_timeout={self.timeout:g} s; is it overloaded or stuck? "
                    "Raise the timeout (below ddp_timeout) or restart it."
                ) from error

        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), concurrency))) as pool:
            return list(pool.map(complete, bodies))

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

    def load_lora_adapter(self, name: str, folder: str) -> None:
        """Register the PEFT adapter in `folder` (a path the server sees) as the model `name`; an
        adapter of that name the server holds already (a version sent again: its weights changed
        outside an optimizer step) is replaced."""
        body = {"lora_name": name, "lora_path": folder}
        try:
            self._lora_request("/v1/load_lora_adapter", body)
        except ServerAnswer as error:
            if "already" not in str(error):
                raise
            self.unload_lora_adapter(name)
            self._lora_request("/v1/load_lora_adapter", body)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget the adapter `name`."""
        self._lora_request("/v1/unload_lora_adapter", {"lora_name": name})

    def _lora_request(self, path: str, body: dict) -> None:
        try:
            self.request("POST", path, body)
        except ServerAnswer as error:
            if error.status != 404:
                raise
            raise ServerAnswer(
                f"The vLLM server at {self.base_url} has no {path}: vllm_weight_sync='lora' needs it started with "
                "--enable-lora --max-lora-rank R (R >= the adapter's rank) --max-loras 2 and the environment "
                "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; or set vllm_weight_sync='files'.",
                error.status,
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
                opened, connect = made[-1], made[-1].connect

                def connect_unless_aborted():
                    # An abort that came while this socket was being made (or after `request` checked)
                    # found no socket to shut down: shut it down here, before the request is sent.
                    connect()
                    with client._lock:
                        if client.aborted:
                            _shut_down(opened)

                opened.connect = connect_unless_aborted
                with client._lock:
                    client._connections.add(opened)
                return opened

            try:
                return super().do_open(connection, request, **kwargs)
            finally:
                with client._lock:
                    client._connections.difference_update(made)

    return Tracked()


def _shut_down(connection: http.client.HTTPConnection) -> None:
    """End `connection`'s exchange: its reads and writes fail at once (a connection not yet opened is left)."""
    if connection.sock is not None:
        try:
            connection.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


def _on_this_machine(host: str | None) -> bool:
    """Whether `host` names this machine: localhost, a loopback address, or 0.0.0.0 / ::."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified
