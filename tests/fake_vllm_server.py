"""A stand-in for a vLLM OpenAI-compatible server (with VLLM_SERVER_DEV_MODE=1), in a thread.

It answers the endpoints `engine.vllm.client` uses with completions that are a pure function of
the request (prompt, n, seed, max_tokens), records every request, loads the weights files it is
told to, and can misbehave: be slow, drop the connection from a given request on (a server that
dies mid-run), or refuse to load weights. The server-mode code runs against it in the main suite, without vLLM.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from safetensors.torch import load_file


class FakeVLLMServer:
    """`completion(prompt, j, body) -> token ids` makes sample j (default: a pattern ending in EOS)."""

    def __init__(self, eos: int, completion=None, logprobs_mode: str = "processed_logprobs"):
        self.eos, self.logprobs_mode = eos, logprobs_mode
        self.completion = completion or self._pattern
        self.requests: list[tuple[str, dict]] = []
        self.loaded: list[dict] = []  # the weights of each reload_weights
        self.delay = 0.0  # seconds before answering a completion
        self.die_after: int | None = None  # drop connections after this many completion requests
        self.refuse_reload = False  # answer /collective_rpc with an error
        self.weight_transfer_config: dict | None = None  # as `--weight-transfer-config` sets it
        self.health_status = 200  # e.g. 503: up, not ready
        self.lora_config: dict | None = None  # as --enable-lora --max-lora-rank sets it
        self.lora_routes = True  # as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True adds them
        self.adapters: dict[str, dict] = {}  # registered LoRA adapters: name -> their tensors
        self.adapter_loads: list[tuple[str, dict]] = []  # every /v1/load_lora_adapter: (name, tensors)
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _pattern(self, prompt: list[int], j: int, body: dict) -> list[int]:
        start = (sum(prompt) + 7 * j + body["seed"] % 5) % 50 + 40
        return [start + t for t in range(min(j + 1, body["max_tokens"] - 1))] + [self.eos]

    def completions(self) -> list[dict]:
        return [body for path, body in self.requests if path == "/v1/completions"]

    def _answer(self, path: str, body: dict) -> dict | None:
        if path == "/health":
            return {}
        if path.startswith("/server_info"):
            config = {"logprobs_mode": self.logprobs_mode, "dtype": "torch.float32"}
            transfer = self.weight_transfer_config
            return {
                "vllm_config": {
                    "model_config": config, "weight_transfer_config": transfer, "lora_config": self.lora_config
                }
            }  # fmt: skip
        if path == "/collective_rpc" and not self.refuse_reload:
            self.loaded.append(load_file(body["kwargs"]["weights_path"] + "/model.safetensors"))
            return {"results": [None]}
        if path == "/reset_prefix_cache":
            return {"success": True}
        if path.endswith("_lora_adapter") and self.lora_routes:
            return self._lora(path, body["lora_name"], body.get("lora_path"))
        if path == "/v1/completions" and body.get("model", "served") not in ("served", *self.adapters):
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
        if path == "/v1/completions":
            choices = []
            for j in range(body["n"]):
                ids = self.completion(body["prompt"], j, body)[: body["max_tokens"]]
                logps = [-0.1 * (t + 1) for t in range(len(ids))]
                choices.append({"index": j, "token_ids": ids, "logprobs": {"token_logprobs": logps}})
            return {"choices": choices[::-1]}  # any order: the client sorts by index
        return None

    def _lora(self, path: str, name: str, folder: str | None):
        """vLLM's answers: plain text on success, a JSON error otherwise."""
        if path == "/v1/load_lora_adapter":
            if name in self.adapters:
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
            tensors = load_file(folder + "/adapter_model.safetensors")
            self.adapters[name] = tensors
            self.adapter_loads.append((name, tensors))
            return f"Success: LoRA adapter '{name}' added successfully."
        if self.adapters.pop(name, None) is None:
            return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}}
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                with server.lock:
                    server.requests.append((self.path, body))
                    dead = server.die_after is not None and len(server.completions()) > server.die_after
                if dead:
                    self.connection.close()  # no answer at all, as a killed server
                    return
                if self.path == "/v1/completions" and server.delay:
                    threading.Event().wait(server.delay)
                answer = server._answer(self.path, body)
                status, answer = answer if isinstance(answer, tuple) else (200, answer)
                if answer is None:
                    status, answer = 404, {"detail": "Not Found"}
                text = isinstance(answer, str)
                data = answer.encode() if text else json.dumps(answer).encode()
                self.send_response(server.health_status if self.path == "/health" else status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

        return Handler
