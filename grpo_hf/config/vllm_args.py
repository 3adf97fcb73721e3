"""The vLLM settings of `GRPOConfig`: colocate (an engine in each training process) or server mode,
the server's address and timeouts, how new weights reach it, and the colocated engine's memory.
TRL 1.16's names and meanings; grpo-hf's own additions are marked "(grpo-hf)" in their help.

`GRPOConfig` inherits these fields; `check_generation_settings` (`generation_args`) calls
`_check_vllm` when vLLM generates. `vllm_settings()` hands the engine what it takes, typed.
"""

import importlib.util
import os
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import urlparse

import torch

from grpo_hf.config.checks import check_choices, check_ranges
from grpo_hf.engine.generation import VLLMSettings
from grpo_hf.engine.vllm import VLLM_INSTALL

VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("vllm", "transformers")
VLLM_WEIGHT_SYNCS = ("auto", "files", "nccl", "lora")
# vLLM 0.32's SamplingParams fields that its /v1/completions request also takes: the generation_kwargs
# either vLLM mode accepts. A server ignores a field it does not know (it only logs it), so a name is
# checked here, before anything starts, without vLLM (tests_vllm/test_colocate.py compares the list
# with vLLM's own classes).
VLLM_SAMPLING_KEYS = frozenset(
    (
        "allowed_token_ids", "bad_words", "frequency_penalty", "ignore_eos", "include_stop_str_in_output",
        "logit_bias", "logprob_token_ids", "logprobs", "max_tokens", "min_p", "min_tokens", "n",
        "presence_penalty", "prompt_logprobs", "repetition_detection", "repetition_penalty",
        "routed_experts_prompt_start", "seed", "skip_special_tokens", "spaces_between_special_tokens", "stop",
        "stop_token_ids", "stream_interval", "structured_outputs", "temperature", "thinking_token_budget",
        "top_k", "top_p", "watermarking",
    )
)  # fmt: skip


@dataclass
class VLLMArguments:
    """Generation on vLLM: where the engine runs and how it gets the policy's weights."""

    _help_section: ClassVar[tuple[str, str]] = ("vllm", "GRPO, vLLM: colocate or server, weight sync, memory")

    use_vllm: bool = field(
        default=False,
        metadata={"help": "Generate with vLLM (sets generation_backend='vllm'); see vllm_mode."},
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': a vLLM engine inside each training process, on its device. 'server': a vLLM "
            "server started separately (python -m vllm.entrypoints.openai.api_server with "
            "VLLM_SERVER_DEV_MODE=1, see README) at vllm_server_base_url."
        },
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={
            "help": "Colocate: 'vllm' (vLLM's own model code) or 'transformers' (vLLM's transformers backend)."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Colocate: put the engine to sleep (weights and KV cache offloaded) outside generation. "
            "Needs a CUDA GPU (vLLM refuses it on a CPU)."
        },
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Constrain every completion to this regex (vLLM structured outputs)."}
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Server: its root URL, e.g. 'http://localhost:8000' (no /v1); overrides host and port."
        },
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Server: its host, without base_url."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Server: its port, without base_url."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Server: seconds to wait for it to be up at start; then a ConnectionError."},
    )
    vllm_server_request_timeout: float = field(
        default=600.0,
        metadata={
            "help": "(grpo-hf) Server: seconds a generation round (its requests together) or a weight update "
            "may take before the run stops with an error instead of waiting; below ddp_timeout with several "
            "processes."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={"help": "Server: port of the NCCL group that sends weights (vllm_weight_sync='nccl')."},
    )
    vllm_weight_sync: str = field(
        default="auto",
        metadata={
            "help": "(grpo-hf) Server: how new weights reach it. 'files': written to vllm_weight_sync_dir (a "
            "folder the server reads) and loaded with reload_weights; 'nccl': vLLM's weight-transfer API "
            'over NCCL (CUDA; start the server with --weight-transfer-config \'{"backend": "nccl"}\'); '
            "'lora': a LoRA policy's adapter alone, to vllm_weight_sync_dir, registered with /v1/load_lora_adapter "
            "(start the server with --enable-lora --max-lora-rank R --max-loras 2 and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); 'auto': nccl where the server was started with it and CUDA "
            "is here, else files."
        },
    )
    vllm_weight_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "(grpo-hf) Server, 'files' and 'lora': the shared folder; default <output_dir>/_vllm-weights (a '_' "
            "folder: push_to_hub leaves it out). Each update is removed once the next is loaded, the last when "
            "training ends."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Colocate: fraction of the device's memory vLLM may take (on a CPU: of RAM, for the KV "
            "cache; vllm_kv_cache_memory_bytes overrides it)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={"help": "Colocate: vLLM's context window (prompt + completion); default the model's."},
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Colocate: processes that share one engine by tensor parallelism."},
    )
    vllm_kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "(grpo-hf) Colocate: KV-cache size in bytes, instead of vllm_gpu_memory_utilization."
        },
    )
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "(grpo-hf) Colocate: no CUDA graphs / compilation (faster start, slower decoding)."
        },
    )
    vllm_engine_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "(grpo-hf) Colocate: more keyword arguments for vllm.LLM (e.g. max_num_seqs)."},
    )

    def _check_vllm(self) -> None:
        check_choices(
            self,
            (
                ("vllm_mode", VLLM_MODES),
                ("vllm_model_impl", VLLM_MODEL_IMPLS),
                ("vllm_weight_sync", VLLM_WEIGHT_SYNCS),
            ),
        )
        if self.vllm_weight_sync == "lora" and self.vllm_mode != "server":
            raise ValueError(
                "vllm_weight_sync='lora' registers the adapter with a vLLM server: it needs vllm_mode='server'."
            )
        needs_vllm = self.vllm_mode == "colocate" or self.vllm_weight_sync == "nccl"
        if needs_vllm and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                f"use_vllm with vllm_mode={self.vllm_mode!r} needs the vllm package here, and it is not installed. "
                f"To install it: {VLLM_INSTALL}. Or set vllm_mode='server' (a server started elsewhere; nothing "
                "of vLLM needed here), or use_vllm=False to generate with grpo-hf's own decoder."
            )
        if not self.ds3_gather_for_generation:
            raise ValueError(
                "ds3_gather_for_generation=False keeps ZeRO-3's shards for generation, which vLLM cannot use (as "
                "in TRL): set ds3_gather_for_generation=True, or use_vllm=False."
            )
        if self.use_transformers_continuous_batching or self.cache_implementation is not None:
            raise ValueError(
                "use_transformers_continuous_batching and cache_implementation choose transformers' generation, "
                "use_vllm chooses vLLM: unset one of them."
            )
        unknown = sorted(set(self.generation_kwargs) - VLLM_SAMPLING_KEYS)
        if unknown:
            raise ValueError(
                f"generation_kwargs: {unknown} are not vLLM SamplingParams settings its server takes (with "
                "use_vllm, generation_kwargs are vLLM 0.32 SamplingParams keys, e.g. min_tokens, stop, "
                "presence_penalty; a server would silently ignore others); remove them."
            )
        checks = [
            (self.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size must be >= 1"),
            (0 < self.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]"),
            (self.vllm_server_timeout > 0, "vllm_server_timeout must be > 0 seconds"),
            (self.vllm_server_request_timeout > 0, "vllm_server_request_timeout must be > 0 seconds"),
            (
                self.vllm_max_model_length is None or self.vllm_max_model_length >= 1,
                "vllm_max_model_length must be >= 1",
            ),
            (
                self.vllm_kv_cache_memory_bytes is None or self.vllm_kv_cache_memory_bytes > 0,
                "vllm_kv_cache_memory_bytes must be > 0",
            ),
            (
                self.world_size % max(self.vllm_tensor_parallel_size, 1) == 0,
                f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} must divide the number of "
                f"processes ({self.world_size})",
            ),
        ]
        check_ranges(checks)
        no_cuda = self.use_cpu or not torch.cuda.is_available()
        if self.vllm_enable_sleep_mode and no_cuda:
            raise ValueError(
                "vllm_enable_sleep_mode=True: vLLM offers sleep mode on CUDA GPUs only and refuses it on this "
                "device (a CPU); set vllm_enable_sleep_mode=False."
            )
        if self.vllm_mode == "server" and self.vllm_weight_sync == "nccl" and no_cuda:
            raise ValueError(
                "vllm_weight_sync='nccl' sends weights over NCCL, which needs the model on a CUDA GPU; with "
                "use_cpu=True or no GPU use vllm_weight_sync='files' (or 'auto')."
            )
        if self.vllm_mode == "server":
            url = urlparse(self.vllm_base_url)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    f"vllm_server_base_url={self.vllm_base_url!r} is not an http(s) URL; use e.g. "
                    "'http://localhost:8000'."
                )
            if url.path.endswith("/v1"):
                raise ValueError(
                    f"vllm_server_base_url={self.vllm_base_url!r} ends in /v1 (an OpenAI client's base URL): "
                    "grpo-hf calls the server's endpoints (/health, /v1/completions, the development ones) "
                    f"under its root; use {self.vllm_base_url.removesuffix('/v1')!r}."
                )
            longest = max(self.vllm_server_timeout, self.vllm_server_request_timeout)
            if self.world_size > 1 and longest >= self.ddp_timeout:
                raise ValueError(
                    f"vllm_server_timeout={self.vllm_server_timeout:g} s and vllm_server_request_timeout="
                    f"{self.vllm_server_request_timeout:g} s must be below ddp_timeout={self.ddp_timeout} s: while "
                    "process 0 waits for the server (its start, a generation round, a weight update), the other "
                    "processes wait in a collective that fails after ddp_timeout with an error that does not say "
                    "why. Lower them or raise ddp_timeout."
                )

    def vllm_settings(self) -> VLLMSettings:
        """The vLLM backends' settings (`engine.generation.VLLMSettings`)."""
        return VLLMSettings(
            vllm_mode=self.vllm_mode,
            vllm_base_url=self.vllm_base_url,
            vllm_server_timeout=self.vllm_server_timeout,
            vllm_server_request_timeout=self.vllm_server_request_timeout,
            vllm_weight_sync=self.vllm_weight_sync,
            vllm_weights_folder=self.vllm_weights_folder,
            vllm_group_port=self.vllm_group_port,
            vllm_structured_outputs_regex=self.vllm_structured_outputs_regex,
            vllm_tensor_parallel_size=self.vllm_tensor_parallel_size,
            vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            vllm_max_model_length=self.vllm_max_model_length,
            vllm_kv_cache_memory_bytes=self.vllm_kv_cache_memory_bytes,
            vllm_enforce_eager=self.vllm_enforce_eager,
            vllm_enable_sleep_mode=self.vllm_enable_sleep_mode,
            vllm_model_impl=self.vllm_model_impl,
            vllm_engine_kwargs=self.vllm_engine_kwargs,
            max_num_seqs=self.per_device_train_batch_size
            * self.vllm_tensor_parallel_size
            * self.steps_per_generation,
            model_copy_dir=os.path.join(
                os.path.abspath(self.output_dir), "_vllm-model"
            ),  # push_to_hub skips '_'
            trust_remote_code=self.trust_remote_code,
            revision=(self.model_init_kwargs or {}).get("revision"),
            run_name=self.run_name or os.path.basename(os.path.abspath(self.output_dir)),
        )

    @property
    def vllm_base_url(self) -> str:
        """The server's URL: vllm_server_base_url, else http://host:port."""
        url = self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"
        return url.rstrip("/")

    @property
    def vllm_weights_folder(self) -> str:
        """Where 'files' weight sync writes the weights for the server."""
        return self.vllm_weight_sync_dir or os.path.join(self.output_dir, "_vllm-weights")
