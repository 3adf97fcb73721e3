"""The policy's weights as vLLM's loader reads them, and the two ways they reach a server.

`vllm_weights`: `generation_copy.policy_weights` (plain names, LoRA merged, `modules_to_save` and
trained biases under the names of the layers they replace, a tied embedding once), refusing an LM
head that trains apart from the embedding it is tied to (vLLM's model ties them and would drop it).
The weights must be whole: the caller holds `sharding.unsharded_for_generation` around it.

Server mode sends them as files (`FileWeights`: a safetensors file in a folder the server
reads, then `/collective_rpc reload_weights`; works between any two hosts that share a folder,
no NCCL), as a LoRA policy's adapter alone (`AdapterWeights`: a PEFT folder registered with
`/v1/load_lora_adapter`, which requests then name as their model), or over NCCL (`NcclWeights`: vLLM's weight-transfer API, trainer process 0 broadcasting
to the server's workers; CUDA only, so it was not run on the CPU machines this was built on; its
calls were read against vLLM 0.32's source). An NCCL call whose peer never comes blocks for ever:
the rendezvous and each transfer run on a helper thread (`data.calls.call_with_timeout`), given up
after vllm_server_request_timeout.
"""

import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import torch
from torch import nn

from grpo_hf.data.calls import CallTimeout, call_with_timeout
from grpo_hf.engine.generation_copy import policy_weights
from grpo_hf.engine.vllm.client import VLLMClient
from grpo_hf.models.policy import base_model


def ties_embeddings(model: nn.Module) -> bool:
    """Whether the policy's LM head is its input embedding (vLLM's copy ties them too)."""
    base = base_model(model)
    return bool(base.config.get_text_config().tie_word_embeddings)


def vllm_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the names vLLM's `load_weights` takes."""
    tied = ties_embeddings(model)
    for name, weight in policy_weights(model):
        if tied and name == "lm_head.weight":
            raise ValueError(
                "The LM head trains apart from the input embedding it is tied to (e.g. LoRA "
                "modules_to_save=['lm_head']); vLLM's copy of the model ties them and would ignore it. Train "
                "both or neither, or set use_vllm=False."
            )
        yield name, weight


class FileWeights:
    """Weights as one safetensors file per update in `folder`, loaded by the server's reload_weights.

    Each update (a whole copy of the policy) is removed once the next is loaded, or at once when the
    server could not load it; `close` removes the last one (the server holds it in memory)."""

    def __init__(self, client: VLLMClient, folder: str, dtype: torch.dtype):
        self.client, self.folder, self.dtype = client, os.path.abspath(folder), dtype
        self._current: str | None = None
        self._updates = 0

    def send(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        self._updates += 1
        path = os.path.join(self.folder, f"update-{self._updates}")
        os.makedirs(path + ".tmp", exist_ok=True)
        tensors = {name: weight.to("cpu", self.dtype).contiguous() for name, weight in weights}
        save_file(tensors, os.path.join(path + ".tmp", "model.safetensors"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)
        try:
            self.client.reload_weights(path)
        except Exception:
            shutil.rmtree(path, ignore_errors=True)  # the server still holds the previous update
            raise
        self.close()  # the server holds the new weights now
        self._current = path

    def close(self) -> None:
        """Remove the last update's folder."""
        if self._current is not None:
            shutil.rmtree(self._current, ignore_errors=True)
            self._current = None


def run_identity(run_name: str) -> str:
    """What names this run's adapters apart from other runs' on a server they share (each run
    unloads its own older adapters): `run_name` in the characters a model name keeps, at most 24 of
    them, then 8 random hex digits from the OS (not the seeded generators: two runs of one seed
    and one run_name differ, and a resumed run is a new one)."""
    readable = re.sub(r"[^A-Za-z0-9._]+", "-", run_name).strip("-.")[:24].rstrip("-.") or "run"
    return f"{readable}-{secrets.token_hex(4)}"


def adapter_name(run: str, version: int) -> str:
    """The model name under which the server holds policy version `version`'s adapter of the run
    `run` (`run_identity`)."""
    return f"grpo-hf-{run}-v{version}"


def check_adapter(model: nn.Module, lora: dict | None) -> None:
    """Refuse, naming what to change, a policy whose adapter vLLM's LoRA would not reproduce, or a
    server (its lora_config, None without --enable-lora) that cannot take it."""
    from peft import PeftModel

    config = model.peft_config.get("default") if isinstance(model, PeftModel) else None
    if config is None or getattr(config, "peft_type", None) != "LORA":
        problems = ["the policy has no PEFT LoRA adapter (pass peft_config)"]
    else:
        rank = max([config.r, *(config.rank_pattern or {}).values()])
        problems = [
            message
            for wrong, message in (
                (bool(config.modules_to_save), f"modules_to_save={config.modules_to_save}"),
                (bool(getattr(config, "use_dora", False)), "use_dora=True"),
                (config.bias != "none", f"bias={config.bias!r}"),
                (len(model.peft_config) > 1, f"{len(model.peft_config)} adapters"),
                (lora is None, "the server was started without --enable-lora"),
                (
                    lora is not None and rank > lora["max_lora_rank"],
                    f"rank {rank} above the server's --max-lora-rank {(lora or {}).get('max_lora_rank')}",
                ),
            )  # fmt: skip
            if wrong
        ]
    if problems:
        raise ValueError(
            f"vllm_weight_sync='lora' sends the policy's LoRA adapter alone, which vLLM serves only for a plain "
            f"LoRA adapter and a server that takes it: here {', '.join(problems)}. Restart the server with "
            "--enable-lora --max-lora-rank R --max-loras 2 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or set "
            "vllm_weight_sync='files' (the merged weights)."
        )


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain LoRA policy's adapter tensors, copied from its parameters under their state-dict names
    (what PEFT's `save_pretrained` takes as `state_dict`). The parameters must be whole
    (`sharding.unsharded_for_generation`); the model's own `state_dict()` would hand PEFT FSDP2's
    shards (DTensors), whose storage safetensors cannot read."""
    return {name: param.detach().clone() for name, param in model.named_parameters() if "lora_" in name}


class AdapterWeights:
    """A LoRA policy's adapter alone (`save_pretrained` of `adapter_tensors`, whole under FSDP2 /
    ZeRO-3: tens of MB where the merged model is the whole model), written to `folder` and registered
    with the server under its version's name (`adapter_name`, with the run's identity: other runs
    on the server keep theirs). Once it is, this run's one before is unloaded and its folder
    removed: no request asks for it any more
    (synchronous rounds take the newest; async GRPO finishes the rounds of a version before sending
    the next, `episodes.async_rounds`). The newest keeps its folder while registered (the server
    reads an adapter from there again when it left its cache); `close` unloads and removes it."""

    def __init__(self, client: VLLMClient, folder: str):
        self.client, self.folder = client, os.path.abspath(folder)
        self._loaded: list[str] = []  # names, oldest first

    def send(self, model: nn.Module, name: str) -> None:
        """Write the policy's adapter and register it as the model `name`."""
        path = os.path.join(self.folder, name)
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        model.save_pretrained(path + ".tmp", state_dict=adapter_tensors(model), save_embedding_layers=False)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)
        self.client.load_lora_adapter(name, path)
        self._loaded = [loaded for loaded in self._loaded if loaded != name] + [name]
        while len(self._loaded) > 1:
            self._forget(self._loaded.pop(0))

    def _forget(self, name: str) -> None:
        self.client.unload_lora_adapter(name)
        shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def close(self) -> None:
        """Unload every adapter sent and remove its folder (the server serves its base model again)."""
        while self._loaded:
            self._forget(self._loaded.pop())


class NcclWeights:
    """Weights over NCCL with vLLM's weight-transfer API (server started with
    --weight-transfer-config '{"backend": "nccl"}'); process 0 is the sender."""

    def __init__(self, client: VLLMClient, group_port: int):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.client, self.group_port = client, group_port
        self.sync_client = HTTPVLLMWeightSyncClient(client.base_url, timeout=client.timeout)
        self.engine = None

    def send(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        tensors = [(name, weight.to("cuda")) for name, weight in weights]

        class Source(WeightSource):
            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors]

            def __iter__(self):
                return iter(tensors)

        device = torch.cuda.current_device()

        def transfer() -> None:
            torch.cuda.set_device(device)  # a new thread starts on device 0
            if self.engine is None:
                info = NCCLTrainerInitInfo(
                    master_address=_address_towards(self.client.base_url),
                    master_port=self.group_port,
                    world_size=self.client.world_size() + 1,
                    rank=0,
                )
                self.engine = WeightTransferTrainerFactory.trainer_init(
                    info, client=self.sync_client, source=Source()
                )
            self.engine.source = Source()
            self.engine.send_weights()

        within(self.client.timeout, transfer, "The NCCL weight transfer to the vLLM server")

    def close(self) -> None:
        """Nothing on disk to remove."""


def within(seconds: float, work: Callable[[], None], what: str) -> None:
    """`work()` on a thread of its own (`data.calls.call_with_timeout`: one left blocked does not keep
    the process from exiting), given up after `seconds` with a TimeoutError naming the setting; what
    it raised re-raised."""
    try:
        call_with_timeout(work, seconds, what)
    except CallTimeout:
        raise CallTimeout(
            f"{what} did not finish within vllm_server_request_timeout={seconds:g} s (the server's workers "
            "never joined, or stopped mid-transfer); check the server's log, --weight-transfer-config and that "
            "vllm_group_port is open, or set vllm_weight_sync='files'."
        ) from None


def _address_towards(base_url: str) -> str:
    """This machine's address on the route to the server (for the NCCL rendezvous)."""
    url = urlparse(base_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((url.hostname, url.port or 80))  # UDP: no packet is sent
        return probe.getsockname()[0]
