"""`GRPOConfig`: the GRPO settings, on top of `transformers.TrainingArguments`.

The settings come in sections, each a dataclass `GRPOConfig` inherits with its own checks:
`rollout_args` (data, sampling, batch geometry, rewards, dynamic sampling, tools), `loss_args`
(the policy term, importance sampling, KL), `generation_args` (transformers' generate,
generation_kwargs), `vllm_args` (vLLM colocate and server) and `async_args` (async GRPO:
max_staleness). Each section names itself in `_help_section`, which groups `--help`. This file
holds the TrainingArguments defaults GRPO overrides, the model-loading, speed and logging settings,
and `__post_init__`, which resolves and checks them in order, `report_to` last (`reporting`: each
integration it names can start).
"""

import logging
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import TrainingArguments

from grpo_hf.config.async_args import AsyncArguments
from grpo_hf.config.checks import check_choices, check_dicts, check_ranges
from grpo_hf.config.generation_args import GenerationBackendArguments
from grpo_hf.config.loss_args import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    LossArguments,
    check_sampler_settings,
    loss_type_warnings,
)
from grpo_hf.config.reporting import check_report_to
from grpo_hf.config.rollout_args import REWARD_ERROR_POLICIES, SCALE_REWARDS, RolloutArguments
from grpo_hf.config.vllm_args import VLLMArguments
from grpo_hf.engine import native_bf16
from grpo_hf.engine.decoding import DECODERS, QUANTIZED_DECODERS
from grpo_hf.engine.quantization import ROLLOUT_QUANTIZATIONS, fp8_kernel_supported

__all__ = [
    "GENERATION_BACKENDS",
    "GRPOConfig",
    "IMPORTANCE_SAMPLING_LEVELS",  # the section constants, importable from here as before
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "PRECISIONS",
    "REWARD_ERROR_POLICIES",
    "SCALE_REWARDS",
    "default_output_dir",
]

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp32")
GENERATION_BACKENDS = (*DECODERS, "vllm")


@dataclass
class GRPOConfig(
    TrainingArguments,
    AsyncArguments,
    VLLMArguments,
    GenerationBackendArguments,
    LossArguments,
    RolloutArguments,
):
    """Training arguments for `GRPOTrainer`; every GRPO field carries its help text, here or in its
    section (`rollout_args`, `loss_args`, `generation_args`, `vllm_args`, `async_args`)."""

    _help_section: ClassVar[tuple[str, str]] = ("grpo", "GRPO: model loading, precision, speed, logging")
    # Settings that decide one thing together: when the command line gives one of a group, TrlParser
    # drops the others' values from the --config file, so that `--bf16 false` beats `precision: auto`.
    _SETTINGS_DECIDED_TOGETHER: ClassVar[tuple[tuple[str, ...], ...]] = (("precision", "bf16", "fp16"),)

    # Fields that also take a JSON object string (the command line and YAML configs pass strings).
    _VALID_DICT_FIELDS = [
        *TrainingArguments._VALID_DICT_FIELDS,
        "model_init_kwargs",
        "chat_template_kwargs",
        "generation_kwargs",
        "transformers_continuous_batching_config",
        "vllm_engine_kwargs",
    ]

    # ---- Overridden TrainingArguments defaults -------------------------------------------------
    learning_rate: float = field(
        default=1e-6, metadata={"help": "AdamW learning rate (1e-6 as in DeepSeekMath)."}
    )
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps (TRL's 10)."})
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision. Unset (with --fp16 unset too): precision='auto', bf16 where the device "
            "computes it natively (TRL turns bf16 on everywhere; on a CPU without native bf16 it is emulated and "
            "several times slower than float32)."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Recompute activations in backward to save memory (TRL's default: on, as here when unset). "
            "Also settable as activation_checkpointing (transformers' newer name)."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Keep only the dataset's 'prompt' column. Default False: the other columns reach the reward "
            "functions as keyword arguments."
        },
    )

    # ---- Model loading and placement -------------------------------------------------------------
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for from_pretrained when GRPOTrainer loads the model from a name (and for "
            'reward models given by name), e.g. {"dtype": "bfloat16", "attn_implementation": "sdpa"}; a '
            "JSON object string on the command line. 'dtype' defaults to float32 for the policy ('auto' keeps "
            "the checkpoint's); 'revision' also picks the tokenizer's revision."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers (the policy's, reward models' and their tokenizers) that ship "
            "their own Python code to run it."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-Experts: weight of the router's load-balancing loss added to the loss. Unset: the "
            "model config's own coefficient; 0 turns it off. An error on a model without router logits."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "DeepSpeed ZeRO-3: gather the whole model once for generation (fast). False: generate with "
            "the parameters partitioned, each layer gathered at each step (slow), for models too large for "
            "one device; every process then decodes as many steps as the longest."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Zero every dropout in the policy, so old, current and reference log-probs agree."},
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the LM head of the policy, the reference and the generation copy in float32 "
            "(ScaleRL, arXiv 2510.13786). A head tied to the input embeddings keeps their shared weight's dtype "
            "(float32 for a policy loaded in float32) and computes in float32 on it."
        },
    )

    # ---- Speed -------------------------------------------------------------------------------
    precision: str | None = field(
        default=None,
        metadata={
            "help": "'auto': bf16 where the device computes it natively (a CUDA GPU with bf16; a CPU with "
            "AVX-512-BF16 or AMX), float32 elsewhere, logged at start. 'bf16' / 'fp32': that one. It sets "
            "--bf16 (and --use_cpu for bf16 on a CPU). Unset: --bf16 / --fp16 as given. --bf16 or --fp16 on "
            "the command line replace a --config file's precision; set together elsewhere, they must agree."
        },
    )
    generation_backend: str = field(
        default="auto",
        metadata={
            "help": "Which decoder generates: 'auto' (Llama's maths on the raw weights where it reproduces "
            "the model, the model's own forward elsewhere; on a GPU in fixed shapes replayed as CUDA graphs), "
            "'llama' (Llama's maths, rows leaving the batch as they end, or an error), 'llama_static' (Llama's "
            "maths in fixed shapes on a static cache, CUDA graphs on a GPU, or an error), 'llama_compiled' (the same, "
            "its step through torch.compile first: auto's choice on a GPU with Triton), 'transformers' (the "
            "model's own forward with a DynamicCache, any architecture), 'transformers_static' (the model's own "
            "forward in fixed shapes on a StaticCache, CUDA graphs on a GPU, or an error), 'transformers_compiled' "
            "(the same, its step through torch.compile first: auto's choice on a GPU with Triton for models other "
            "than Llama that transformers can compile whole, 'transformers_static' without Triton), 'vllm' (vLLM, "
            "see vllm_mode; use_vllm=True sets it)."
        },
    )
    generation_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Run generation and the no-grad log-prob passes in this dtype ('bfloat16'); training "
            "keeps the model's own dtype. Default: bfloat16 when --bf16 is set, else the model's dtype."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "(TRL's async name) The most tokens (prompt and completion of each row) one process puts "
            "through one log-prob pass. The old and reference passes take a generation round's rows in runs of "
            "consecutive rows up to this many tokens, across micro-batches; a micro-step's policy pass takes its "
            "micro-batch's rows so, one forward and backward per run, the loss of each divided as the whole "
            "micro-batch's. The same number of passes on every process; a row longer than the budget is a pass "
            "of its own. With several processes each optimizer step's rows are first dealt to them by tokens "
            "(as many rows each as before; not under bnpo). Bounds the passes' memory by tokens and evens the "
            "processes' work; results and gradients are the per-micro-batch ones (micro-batches and optimizer "
            "steps unchanged). Not with DeepSpeed, top_entropy_quantile < 1 or a MoE router loss. None "
            "(default) or <= 0: one pass per micro-batch."
        },
    )
    rollout_quantization: str | None = field(
        default=None,
        metadata={
            "help": "(grpo-hf) Sample from a copy of the policy whose matmuls take 8-bit weights (one scale per "
            "output channel), refreshed with the weights each round, LoRA merged first. On a CPU, with "
            "generation_backend 'auto', 'llama', 'transformers' or 'transformers_static': 'int8', activations "
            "rounded to int8 at each call too (PyTorch's fbgemm dynamic int8 linear): the fast one, and the "
            "farthest from the policy (docs/benchmarks.md); 'int8_weight_only': activations as they are, the "
            "weights' rounding alone, at the copy's own speed (PyTorch has no faster CPU kernel for it). 'fp8': "
            "float8 e4m3 weights and activations (one scale per token), torch._scaled_mm on a GPU of compute "
            "capability 8.9+ (generation_backend 'auto', 'llama', 'llama_static', 'llama_compiled' or "
            "'transformers'); emulated, no faster, on a CPU. The sampler's log-probs are the quantized "
            "copy's, so sampler/* shows the mismatch and sampler_is_cap / off_policy_mask_threshold correct for "
            "it. None (default): the copy multiplies in generation_dtype. With vLLM use vLLM's own quantization "
            "(vllm_engine_kwargs)."
        },
    )

    # ---- Logging and faults ----------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "At each log, a table of the latest round's completions with each reward, the advantage and "
            "the reward functions' log_extra columns: printed, sent to wandb, and written to "
            "<output_dir>/completions/completions_<step>.parquet."
        },
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Completions of the table printed, drawn at random; None: all (TRL)."}
    )
    log_unique_prompts: bool = field(
        default=False, metadata={"help": "The wandb completions table keeps one row per prompt (as in TRL)."}
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "A Hub dataset repo ('user/name', or 'name' under the logged-in user; private with "
            "hub_private_repo) the completion files are uploaded to, at most every 2 minutes and at the end of "
            "training. Needs log_completions."
        },
    )
    log_multimodal: bool = field(
        default=True,
        metadata={
            "help": "Accepted for TRL configs; has no effect: grpo-hf trains on text prompts only, so there are "
            "no images or videos to log."
        },
    )
    max_nonfinite_steps: int = field(
        default=3, metadata={"help": "Stop after this many non-finite losses in a row (each is skipped)."}
    )

    def __post_init__(self) -> None:
        self._resolve_device()
        self._resolve_precision()
        self._resolve_checkpointing()
        super().__post_init__()
        # Each section's defaults and command-line strings, then each section's own checks.
        check_dicts(self, ["model_init_kwargs"])
        self._resolve_rollout_settings()
        self._resolve_loss_settings()
        self._check_own_settings()
        self._check_rollout_settings()
        self._check_loss_settings()
        # Then the checks across sections, in this order.
        self.check_generation_settings()  # first: it resolves use_vllm, which the loss checks read
        self._check_rollout_quantization()
        self.check_loss_combinations()
        self._resolve_generation_batch()
        self.check_async_settings()
        if self.eval_strategy != "no" or self.do_eval:
            self.check_eval_batch()
        check_report_to(self.report_to, main_process=self.process_index == 0)  # last: it may set WANDB_MODE

    def _resolve_device(self) -> None:
        """use_cpu where torch sees no accelerator (CUDA, MPS, XPU, ...): the device follows the hardware,
        so no config has to name it. The CPU is the device there either way; use_cpu also keeps
        transformers from pinning memory for an accelerator that is not there (torch warns about it)."""
        if not torch.accelerator.is_available():
            self.use_cpu = True

    def _resolve_precision(self) -> None:
        """precision -> the --bf16 flag; 'auto' from what the device computes natively. Unset, with
        neither --bf16 nor --fp16 given, it is 'auto' (TRL's default is bf16 on). bf16 without a CUDA
        GPU, whichever setting asked for it, trains on the CPU (transformers wants use_cpu for it)."""
        if self.precision is None and (self.bf16 is not None or self.fp16):
            self.bf16 = bool(self.bf16)
        else:
            self.precision = self.precision or "auto"
            self._check_precision()
            auto = self.precision == "auto"
            self.bf16 = native_bf16(self.use_cpu)[0] if auto else self.precision == "bf16"
        if self.bf16 and not torch.cuda.is_available():
            self.use_cpu = True
        self._check_launcher_precision()

    def _check_launcher_precision(self) -> None:
        """transformers trains in the accelerate config's mixed_precision (`accelerate launch` exports it)
        whenever bf16 and fp16 are both off: a float32 run under a bf16 launcher config would train in
        bf16 without a word. Refused, naming both."""
        launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        chosen = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        if launcher in ("bf16", "fp16") and launcher != chosen:
            raise ValueError(
                f"The accelerate config this run was launched with says mixed_precision: {launcher}, and the run's "
                f"own precision is {'float32' if chosen == 'no' else chosen} (precision={self.precision!r}, "
                f"bf16={self.bf16}, fp16={self.fp16}): transformers would train in {launcher}. Set "
                "mixed_precision: 'no' in the accelerate config (the run's precision then decides), or pass "
                f"{'--precision bf16' if launcher == 'bf16' else '--fp16 true'}."
            )

    def _check_precision(self) -> None:
        """precision is a known name, and bf16 / fp16, where given beside it, say the same thing."""
        wins = "(on the command line, --bf16 / --fp16 win over a --config file's precision)"
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not one of {PRECISIONS}: pass --precision auto (bf16 where the "
                "device computes it natively), --precision bf16 or --precision fp32; for fp16 leave precision "
                "unset and pass --fp16 true."
            )
        if self.fp16:
            raise ValueError(
                f"precision={self.precision!r} and fp16=True both set the precision, and precision has no fp16: "
                f"for fp16 leave precision unset and pass --fp16 true, else drop fp16 {wins}."
            )
        if self.bf16 is not None and (self.precision == "auto" or self.bf16 != (self.precision == "bf16")):
            name = "bf16" if self.bf16 else "fp32"
            raise ValueError(
                f"precision={self.precision!r} and bf16={self.bf16} both set the precision: keep one, "
                f"--precision {name} or --bf16 {str(self.bf16).lower()} with precision unset {wins}."
            )

    def _resolve_checkpointing(self) -> None:
        """Gradient checkpointing on unless set (TRL's default), under either of transformers' names
        (transformers >= 5.20 calls it activation_checkpointing and warns that the old name, TRL's and
        ours, is deprecated: a value given under the old name is handed to the new one, no warning)."""
        if not hasattr(self, "activation_checkpointing"):  # transformers < 5.20: the old name only
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = True
            return
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new) is None:
                setattr(self, new, getattr(self, old))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = True

    def _check_own_settings(self) -> None:
        """The settings declared in this file: model loading, speed, logging and faults."""
        check_choices(self, (("generation_backend", GENERATION_BACKENDS),))
        if self.token_budget is not None and self.token_budget <= 0:  # TRL's "<= 0 disables"
            self.token_budget = None
        if self.generation_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(
                f"generation_dtype={self.generation_dtype!r}: use 'bfloat16', 'float16' or 'float32'."
            )
        checks = [
            (
                self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
                "router_aux_loss_coef must be >= 0 (0 turns the load-balancing loss off)",
            ),
            (self.max_nonfinite_steps >= 1, "max_nonfinite_steps must be >= 1"),
            (
                self.num_completions_to_print is None or self.num_completions_to_print >= 0,
                "num_completions_to_print must be >= 0 (or None: all)",
            ),
            (
                self.log_completions_hub_repo is None or self.log_completions,
                "log_completions_hub_repo is set but log_completions is False; set log_completions=True to "
                "upload the completions, or unset log_completions_hub_repo",
            ),
        ]
        check_ranges(checks)

    def _check_rollout_quantization(self) -> None:
        """rollout_quantization: a known kind, and where its kernels run (after use_vllm is resolved)."""
        if self.rollout_quantization is None:
            return
        if self.rollout_quantization not in ROLLOUT_QUANTIZATIONS:
            raise ValueError(
                f"rollout_quantization={self.rollout_quantization!r}: use one of {ROLLOUT_QUANTIZATIONS}, or None."
            )
        if self.use_vllm:
            raise ValueError(
                "rollout_quantization quantizes grpo-hf's own sampler; vLLM quantizes with its own setting: unset "
                "rollout_quantization and pass vllm_engine_kwargs={'quantization': 'fp8'} (colocate) or start the "
                "server with --quantization fp8."
            )
        if not self.use_cpu and torch.cuda.is_available():
            self._check_gpu_rollout_quantization()
        decoders = QUANTIZED_DECODERS[self.rollout_quantization]
        if self.generation_backend not in decoders:
            raise ValueError(
                f"rollout_quantization={self.rollout_quantization!r} decodes with generation_backend in "
                f"{decoders}, not {self.generation_backend!r}; set generation_backend='auto' or unset "
                "rollout_quantization."
            )

    def _check_gpu_rollout_quantization(self) -> None:
        """On a GPU: 'fp8' only, where the GPU multiplies FP8 (the int8 kinds are CPU kernels)."""
        if self.rollout_quantization != "fp8":
            raise ValueError(
                f"rollout_quantization={self.rollout_quantization!r} runs on a CPU (PyTorch's fbgemm int8 kernels), "
                "and this run trains on a GPU: use rollout_quantization='fp8', or unset it (or use vLLM with "
                "its own quantization)."
            )
        device = torch.device("cuda", torch.cuda.current_device())
        if not fp8_kernel_supported(device):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"rollout_quantization='fp8' needs a GPU that multiplies FP8 (compute capability 8.9 or later: "
                f"Ada, Hopper, Blackwell); this one is {major}.{minor}, where FP8 would be emulated, slower than "
                "bf16: unset rollout_quantization."
            )

    def check_loss_combinations(self) -> None:
        """Errors for loss and importance-sampling settings that contradict each other, warnings for
        those that do not fit (TRL's, and two of ours); tests that set generation_backend after
        construction run it again."""
        check_sampler_settings(self)
        for warning in loss_type_warnings(self):
            logger.warning(warning)


def default_output_dir(model: object, trainer: str = "GRPO") -> str:
    """TRL's output_dir when a trainer gets no args: '<model name>-<trainer>' (the last part of a model
    id or path, or of a model object's `name_or_path`)."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or type(model).__name__
    return f"{str(name).rstrip('/').split('/')[-1]}-{trainer}"
