"""The generation-backend settings of `GRPOConfig`: vLLM, transformers' generate and continuous
batching, and `generation_kwargs`. TRL 1.16's names and meanings; grpo-hf's own additions are
marked "(grpo-hf)" in their help.

`GRPOConfig` inherits these fields and calls `check_generation_settings` in its `__post_init__`.
After it, vLLM generates exactly when `generation_backend == "vllm"` (`use_vllm=True` sets it).
"""

import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch
from transformers import GenerationConfig

from grpo_hf.config.checks import check_choices, check_dicts, check_ranges
from grpo_hf.engine.generation import GenerationSettings, Sampling, VLLMSettings
from grpo_hf.engine.vllm import VLLM_INSTALL

logger = logging.getLogger(__name__)

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
class GenerationBackendArguments:
    """Which engine samples the completions, and its settings (see the module docstring)."""

    # ---- Sampling settings passed through ------------------------------------------------------
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "More sampling settings, overriding the ones above where they clash: GenerationConfig "
            "keys for our decoder and transformers (e.g. no_repeat_ngram_size, suppress_tokens, num_beams; keys "
            "our decoder does not implement switch to transformers' generate), with vLLM the SamplingParams "
            "keys its server also takes, in both modes (e.g. presence_penalty, stop, min_tokens)."
        },
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={
            "help": "KV-cache implementation for generation without vLLM (e.g. 'static'); when set, "
            "transformers' generate samples (with that cache) instead of our decoder."
        },
    )
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={"help": "Sample with transformers' continuous batching engine (model.generate_batch)."},
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of transformers.ContinuousBatchingConfig (max_memory_percent defaults "
            "to 0.5 here, leaving memory for training)."
        },
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated: use use_transformers_continuous_batching."}
    )

    # ---- vLLM ------------------------------------------------------------------------------------
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

    def check_generation_settings(self) -> None:
        """Resolve use_vllm / generation_backend and check every generation setting (no model, no vLLM import)."""
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated: use use_transformers_continuous_batching.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        if self.use_vllm or self.generation_backend == "vllm":
            self.use_vllm, self.generation_backend = True, "vllm"
        check_dicts(
            self, ("generation_kwargs", "transformers_continuous_batching_config", "vllm_engine_kwargs")
        )
        self.generation_kwargs = dict(self.generation_kwargs or {})
        if self.use_vllm:
            self._check_vllm()
        else:
            self._check_transformers_generation()
        self._warn_truncated_sampling()

    def _check_transformers_generation(self) -> None:
        unknown = sorted(set(self.generation_kwargs) - set(GenerationConfig().to_dict()))
        if unknown:
            raise ValueError(
                f"generation_kwargs: {unknown} are not GenerationConfig settings (without vLLM, generation_kwargs "
                "are transformers.GenerationConfig keys); remove them."
            )
        if self.generation_kwargs.get("num_return_sequences", 1) != 1:
            raise ValueError(
                "generation_kwargs: num_return_sequences must be 1 (each prompt is already repeated "
                "num_generations times); set num_generations instead."
            )
        if self.vllm_enable_sleep_mode or self.vllm_structured_outputs_regex is not None:
            logger.warning(
                "vllm_enable_sleep_mode / vllm_structured_outputs_regex apply with use_vllm=True only."
            )

    def _warn_truncated_sampling(self) -> None:
        """top_p / top_k / min_p (as set, or in generation_kwargs) truncate what every backend samples from."""
        knobs = {"top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        knobs |= {name: value for name, value in self.generation_kwargs.items() if name in knobs}
        cut = [k for k, v in knobs.items() if v is not None and (v < 1 if k == "top_p" else v > 0)]
        if cut:
            logger.warning(
                f"{' / '.join(cut)} truncate the sampling distribution. The sampler's log-probs (grpo-hf's decoder, "
                "vLLM's with logprobs_mode='processed_logprobs') are those of the truncated, renormalised "
                "distribution actually sampled, the policy's are over the whole vocabulary: on each token pi_old / "
                "pi_sampler is the probability mass the truncation kept (<= 1) times the sampler / trainer "
                "mismatch. The importance weights (vllm_importance_sampling_correction, sampler_is_cap) so correct "
                "for the truncation too (the sequence modes multiply it over a completion's tokens), and "
                "off_policy_mask_threshold and sampler/ratio_* count it."
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

    def sampling(self, eos_token_ids: list[int], pad_token_id: int) -> Sampling:
        """What each generation call samples (cache_implementation joins the GenerationConfig keys)."""
        extra = dict(self.generation_kwargs)
        if self.cache_implementation is not None:
            extra["cache_implementation"] = self.cache_implementation
        return Sampling(
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            generation_kwargs=extra,
            seed=self.seed,
        )

    def generation_settings(self) -> GenerationSettings:
        """What the engine takes of these settings, typed (`engine.generation.GenerationSettings`)."""
        return GenerationSettings(
            generation_backend=self.generation_backend,
            generation_dtype=self.generation_dtype,
            bf16=bool(self.bf16),
            cache_implementation=self.cache_implementation,
            generation_kwargs=dict(self.generation_kwargs),
            use_transformers_continuous_batching=self.use_transformers_continuous_batching,
            transformers_continuous_batching_config=self.transformers_continuous_batching_config,
            ds3_gather_for_generation=self.ds3_gather_for_generation,
            seed=self.seed,
            vllm=self.vllm_settings() if self.generation_backend == "vllm" else None,
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
