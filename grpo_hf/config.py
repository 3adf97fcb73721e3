"""`GRPOConfig`: the GRPO settings, on top of `transformers.TrainingArguments`.

Batch sizes count completions, not prompts: `per_device_train_batch_size=8` with
`num_generations=4` trains on two prompts' groups per device and micro-step. One generation round
produces `generation_batch_size` completions across all processes and feeds
`steps_per_generation` micro-steps, `num_iterations` times over (the seeds' "ppo_epochs").
"""

import logging
import warnings
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from grpo_hf.advantages import AGGREGATIONS
from grpo_hf.config_generation import GenerationBackendArguments
from grpo_hf.engine import native_bf16
from grpo_hf.engine.decoding import DECODERS
from grpo_hf.policy_terms import CLIPPED_LOSS_TYPES, POLICY_TERMS, loss_type_warnings
from grpo_hf.sampler_correction import IS_MODES, check_sampler_settings

logger = logging.getLogger(__name__)

LOSS_TYPES = tuple(POLICY_TERMS)
KL_ESTIMATORS = ("k1", "k2", "k3")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
REWARD_ERROR_POLICIES = ("raise", "retry", "zero")
PRECISIONS = ("auto", "bf16", "fp32")
GENERATION_BACKENDS = (*DECODERS, "vllm")


@dataclass
class GRPOConfig(TrainingArguments, GenerationBackendArguments):
    """Training arguments for `GRPOTrainer`; every GRPO field carries its help text below, the
    generation-backend ones (vLLM, generation_kwargs, ...) in `config_generation`."""

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

    # ---- Data and generation -------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (G)."})
    num_generations_eval: int | None = field(
        default=None,
        metadata={
            "help": "Completions per prompt in evaluation (fewer saves time; 1 allowed); default num_generations."
        },
    )
    shuffle_dataset: bool = field(
        default=True,
        metadata={
            "help": "Shuffle the training prompts (each epoch anew; a streamed dataset through a shuffle buffer)."
        },
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt and completion ids to a multiple of this many tokens (fewer distinct shapes for "
            "compiled backends). 'auto': 128 on AWS Neuron, no padding elsewhere; None / 'none': no padding."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments for apply_chat_template where chat prompts, tool results and reward "
            'model inputs are rendered, e.g. {"enable_thinking": false}; a JSON object string on the command line.'
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Prompts longer than this many tokens keep their last tokens (with a warning). Default None: "
            "no truncation (TRL has no such setting)."
        },
    )
    max_completion_length: int = field(
        default=512, metadata={"help": "Maximum new tokens per completion (TRL's 512)."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature; log-probs use the same."}
    )
    top_k: int = field(default=0, metadata={"help": "Keep only the k most likely tokens; 0 disables."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass; 1.0 disables."})
    min_p: float | None = field(
        default=None, metadata={"help": "Drop tokens below min_p times the top token's probability."}
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Penalty for repeated tokens; 1.0 disables."}
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-steps fed by one generation round; default gradient_accumulation_steps."},
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation round over all processes; alternative to steps_per_generation."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Exclude completions that hit max_completion_length from the loss (DAPO)."},
    )

    # ---- Rewards and advantages ----------------------------------------------------------------
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; default all 1.0."}
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "How several reward functions combine: 'sum_then_normalize' (the weighted sum of the rewards, "
            "then the advantage per scale_rewards) or 'normalize_then_sum' (GDPO, arXiv 2601.05242: each "
            "function's rewards normalised within their group, their weighted sum then centred and scaled over "
            "the whole batch; scale_rewards does not apply)."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantage scale: 'group' std (DeepSeekMath), 'batch' std, or 'none' (Dr. GRPO); "
            "True / False (also 'true' / 'false' from the command line) mean 'group' / 'none', as in TRL."
        },
    )
    reward_error_policy: str = field(
        default="raise",
        metadata={
            "help": "What a reward function that raises does (it is retried one completion at a time to find "
            "the completion): 'raise' stops the run, showing that completion, also when every completion "
            "scores alone; 'retry' uses the one-at-a-time scores then, counting such batches in "
            "'reward_retried_batches'; 'zero' also scores a completion that fails alone 0, counted in "
            "'reward_errors'."
        },
    )

    # ---- Dynamic sampling (DAPO, arXiv 2503.14476) -----------------------------------------------
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Drop groups whose rewards are all equal (they teach nothing) and generate more prompts "
            "(a full generation batch per extra round, from a second shuffled pass over the dataset) until "
            "the generation batch holds only groups that teach."
        },
    )
    max_dynamic_sampling_rounds: int = field(
        default=4,
        metadata={
            "help": "Cap on extra generation rounds per generation batch with dynamic_sampling. When it is "
            "reached, the batch is filled with the earliest dropped groups (advantage 0: they add KL and "
            "entropy terms and loss tokens, no policy gradient)."
        },
    )

    # ---- Tools (multi-turn rollouts: GRPOTrainer(tools=..., environment_factory=...)) -------------
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Turns whose tool calls are answered per episode (TRL's tool-calling iterations); a call "
            "after that is left unanswered and the episode ends; 0 answers none. None: no limit but "
            "max_completion_length, which counts model and tool tokens."
        },
    )
    tool_timeout: float = field(
        default=10.0,
        metadata={
            "help": 'Seconds a tool call may take; after that the model gets {"error": ...} instead and the '
            "call counts as failed."
        },
    )

    # ---- Policy loss ---------------------------------------------------------------------------
    num_iterations: int = field(
        default=1, metadata={"help": "Passes over each generation round (mu in DeepSeekMath)."}
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range: ratio >= 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip range (DAPO clip-higher, e.g. 0.28); default epsilon."}
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Cap on the unclipped ratio for negative advantages (two-sided clip), e.g. 4.0."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "The loss (grpo_hf/policy_terms.py). Clipped surrogate, aggregated as: 'grpo' (per-sequence "
            "mean), 'bnpo' (micro-batch token mean), 'dr_grpo' (sum / (B * max_completion_length)), 'dapo' (token "
            "mean over all the tokens, on every process, that feed one optimizer step), 'luspo' (per-sequence sum, "
            "then mean; LUSPO, with importance_sampling_level='sequence'). Other policy terms: 'cispo' (clipped, "
            "detached importance weight times log-prob, MiniMax-M1; dapo's mean), 'sapo' (soft sigmoid gate, "
            "SAPO; grpo's mean), 'vespo' (Gamma-shaped sequence weight, VESPO; dapo's mean)."
        },
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "SAPO gate temperature for tokens with advantage <= 0."}
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "SAPO gate temperature for tokens with advantage > 0."}
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={
            "help": "VESPO power k for advantages >= 0: how hard sequences with ratio < 1 are down-weighted."
        },
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={
            "help": "VESPO decay lambda for advantages >= 0: how hard sequences with ratio > 1 are down-weighted."
        },
    )
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO power k for advantages < 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO decay lambda for advantages < 0."})
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "'token' ratios (GRPO) or one ratio per sequence (GSPO, arXiv 2507.18071)."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2's delta, e.g. 0.5): a sequence with a negative "
            "advantage whose mean log(pi_sampler / pi) over its tokens exceeds this leaves the policy term. None: off."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep the policy term (and the entropy bonus) only on the top fraction of loss tokens by "
            "entropy, quantile over the micro-batch on every process (arXiv 2506.01939 recommends 0.2); 1.0 keeps "
            "all, 0.0 only the highest."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus (arXiv 2504.20571): loss -= coef * the mean token entropy (over the optimizer "
            "step's loss tokens on every process), for every loss_type alike. The starting value with "
            "use_adaptive_entropy."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312): after each optimizer step "
            "entropy_coef moves up by entropy_coef_delta if the step's entropy was <= entropy_target, else down; "
            "the bonus applies only while the entropy is <= entropy_target."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Lower bound of the adaptive entropy_coef."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Upper bound of the adaptive entropy_coef."}
    )
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Step of the adaptive entropy_coef per optimizer step."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Target mean token entropy (nats) of the adaptive entropy_coef, over the tokens the bonus acts "
            "on. 0.2 engages only near collapse; set it near the 'entropy' logged early in training."
        },
    )

    # ---- Importance sampling against the sampler (grpo_hf/sampler_correction.py) ----------------
    sampler_is_cap: float | None = field(
        default=None,
        metadata={
            "help": "Our decoder: truncated importance sampling (token level), weighting each token's policy term "
            "by min(pi_old / pi_sampler, cap), correcting for the sampler (bf16 copy, top_p ...) drawing from "
            "another distribution than the policy's; e.g. 2.0. Off by default. With vLLM use "
            "vllm_importance_sampling_*. The mismatch is logged either way ('sampler/*', 'sampling/*')."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "When vLLM generates: weight the policy term by the importance ratio pi_old / pi_vllm, bounded "
            "as vllm_importance_sampling_mode says."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate' / 'sequence_truncate': the token's / sequence's ratio clipped to "
            "[clip_min, clip_max]; 'token_mask' / 'sequence_mask': set to 0 outside it."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the vLLM importance ratio; None: none."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the vLLM importance ratio; None: none."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated (as in TRL): use vllm_importance_sampling_clip_max."}
    )

    # ---- KL to the reference -------------------------------------------------------------------
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient. 0 (TRL's default) loads no reference model; DeepSeekMath used 0.04, "
            "DeepSeek-R1 0.001."
        },
    )
    kl_estimator: str = field(
        default="k3", metadata={"help": "KL estimator: 'k1', 'k2' or 'k3' (Schulman's approximations)."}
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Weight the KL term by the importance ratio pi / pi_old (differentiable), making its gradient "
            "the unbiased gradient of KL(pi || pi_ref) (DeepSeek-V3.2, arXiv 2512.02556); changes the gradient even "
            "at ratio 1."
        },
    )
    target_kl: float | None = field(
        default=None,
        metadata={
            "help": "Adaptive KL: beta follows a proportional controller towards this KL (arXiv 1909.08593)."
        },
    )
    kl_horizon: int = field(
        default=10000, metadata={"help": "Adaptive KL horizon, in completions (10000 in arXiv 1909.08593)."}
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "Move the reference towards the policy every ref_model_sync_steps."}
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "Reference update: ref = alpha * policy + (1 - alpha) * ref."}
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "Optimizer steps between reference updates."}
    )

    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Zero every dropout in the policy, so old, current and reference log-probs agree."},
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the LM head of the policy, the reference and the generation copy in float32 "
            "(ScaleRL, arXiv 2510.13786); only for models whose LM head is not tied to the input embeddings."
        },
    )

    # ---- Speed -------------------------------------------------------------------------------
    precision: str | None = field(
        default=None,
        metadata={
            "help": "'auto': bf16 where the device computes it natively (a CUDA GPU with bf16; a CPU with "
            "AVX-512-BF16 or AMX), float32 elsewhere, logged at start. 'bf16' / 'fp32': that one. It sets "
            "--bf16 (and --use_cpu for bf16 on a CPU). Unset: --bf16 / --fp16 as given."
        },
    )
    generation_backend: str = field(
        default="auto",
        metadata={
            "help": "Which decoder generates: 'auto' (Llama's maths on the raw weights where it reproduces "
            "the model, the model's own forward elsewhere), 'llama' (that one, or an error), 'transformers' "
            "(the model's own forward with a DynamicCache, any architecture), 'vllm' (vLLM, see vllm_mode; "
            "use_vllm=True sets it)."
        },
    )
    generation_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Run generation and the no-grad log-prob passes in this dtype ('bfloat16'); training "
            "keeps the model's own dtype. Default: bfloat16 when --bf16 is set, else the model's dtype."
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
        self._resolve_precision()
        self._resolve_checkpointing()
        super().__post_init__()
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        self._resolve_scale_rewards()
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        self._resolve_data_settings()
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated (as in TRL); use vllm_importance_sampling_clip_max.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        self._check_choices()
        self._check_ranges()
        self.check_generation_settings()  # first: it resolves use_vllm, which the loss checks read
        self.check_loss_combinations()
        self._resolve_generation_batch()
        if self.eval_strategy != "no" or self.do_eval:
            self.check_eval_batch()

    def check_eval_batch(self) -> None:
        """Evaluation batches must hold whole groups too (the trainer also calls this, before
        loading the model, when it is given an eval_dataset)."""
        per_step = self.per_device_eval_batch_size * self.world_size
        if per_step % self.num_generations_eval:
            raise ValueError(
                f"The evaluation batch ({per_step} completions = per_device_eval_batch_size "
                f"{self.per_device_eval_batch_size} x {self.world_size} processes) must be divisible by "
                f"num_generations_eval={self.num_generations_eval} (default num_generations); change "
                "per_device_eval_batch_size or num_generations_eval."
            )

    def _resolve_data_settings(self) -> None:
        """pad_to_multiple_of and the dict settings from their command-line strings; unsupported batching."""
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.strip().lower()
            if text not in ("none", "null") and not text.isdigit():
                raise ValueError(
                    f"pad_to_multiple_of={self.pad_to_multiple_of!r}: give a positive integer, 'auto' or None."
                )
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.pad_to_multiple_of == "auto":  # Neuron compiles once per input shape
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        for name in ("model_init_kwargs", "chat_template_kwargs"):
            if not isinstance(getattr(self, name), dict | None):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not a dict; pass a dict, or a JSON object string "
                    "('{\"key\": value}') on the command line."
                )
        self.chat_template_kwargs = dict(self.chat_template_kwargs or {})
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size is not supported: it halves per_device_train_batch_size on out-of-memory, "
                "and then a generation batch no longer holds whole groups of num_generations completions. Set "
                "auto_find_batch_size=False and lower per_device_train_batch_size (and raise "
                "gradient_accumulation_steps) instead."
            )

    def _resolve_precision(self) -> None:
        """precision -> the --bf16 flag; 'auto' from what the device computes natively. Unset, with
        neither --bf16 nor --fp16 given, it is 'auto' (TRL's default is bf16 on)."""
        if self.precision is None:
            if self.bf16 is not None or self.fp16:
                self.bf16 = bool(self.bf16)
                return
            self.precision = "auto"
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {PRECISIONS}; or leave it unset.")
        if self.fp16 or (self.bf16 and self.precision != "bf16"):
            raise ValueError(
                f"precision={self.precision!r} sets the precision itself; unset --bf16 / --fp16, or unset precision."
            )
        auto = self.precision == "auto"
        self.bf16 = native_bf16(self.use_cpu)[0] if auto else self.precision == "bf16"
        if self.bf16 and not torch.cuda.is_available():
            self.use_cpu = True  # transformers asks for it to run bf16 on a CPU

    def _resolve_checkpointing(self) -> None:
        """Gradient checkpointing on unless set (TRL's default), under either of transformers' names
        (transformers >= 5.20 calls it activation_checkpointing, the old name a deprecated alias)."""
        if self.gradient_checkpointing is None and getattr(self, "activation_checkpointing", None) is None:
            newer = hasattr(self, "activation_checkpointing")
            setattr(self, "activation_checkpointing" if newer else "gradient_checkpointing", True)

    def _resolve_scale_rewards(self) -> None:
        """TRL's booleans: True -> 'group', False -> 'none' (strings from the command line too)."""
        as_text = str(self.scale_rewards).lower()
        self.scale_rewards = {"true": "group", "false": "none"}.get(as_text, self.scale_rewards)
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            warnings.warn(
                f"scale_rewards={self.scale_rewards!r} has no effect with multi_objective_aggregation="
                "'normalize_then_sum': each reward is normalised within its group and their sum over the batch.",
                stacklevel=3,
            )

    def _check_choices(self) -> None:
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("kl_estimator", KL_ESTIMATORS),
            ("scale_rewards", SCALE_REWARDS),
            ("multi_objective_aggregation", AGGREGATIONS),
            ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
            ("vllm_importance_sampling_mode", IS_MODES),
            ("reward_error_policy", REWARD_ERROR_POLICIES),
            ("generation_backend", GENERATION_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not one of {allowed}; set {name} to one of them."
                )
        if self.generation_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(
                f"generation_dtype={self.generation_dtype!r}: use 'bfloat16', 'float16' or 'float32'."
            )

    def _check_ranges(self) -> None:
        checks = [
            (
                self.num_generations >= 2,
                "num_generations must be >= 2: a group of one has no relative advantage",
            ),
            (
                self.num_generations_eval >= 1,
                "num_generations_eval must be >= 1 (a group of one scores with advantage 0)",
            ),
            (
                self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
                "pad_to_multiple_of must be >= 1 (or None: no padding)",
            ),
            (
                self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
                "router_aux_loss_coef must be >= 0 (0 turns the load-balancing loss off)",
            ),
            (self.max_completion_length >= 1, "max_completion_length must be >= 1"),
            (self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length must be >= 1"),
            (self.temperature > 0, "temperature must be > 0 (log-probs divide by it)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.min_p is None or 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.num_iterations >= 1, "num_iterations must be >= 1"),
            (self.epsilon > 0, "epsilon must be > 0"),
            (self.epsilon_high > 0, "epsilon_high must be > 0"),
            (
                self.delta is None
                or self.loss_type not in CLIPPED_LOSS_TYPES
                or self.delta > 1 + self.epsilon_high,
                "delta must be > 1 + epsilon_high",
            ),
            (self.sapo_temperature_neg > 0, "sapo_temperature_neg must be > 0"),
            (self.sapo_temperature_pos > 0, "sapo_temperature_pos must be > 0"),
            (min(self.vespo_k_pos, self.vespo_k_neg) >= 0, "vespo_k_pos and vespo_k_neg must be >= 0"),
            (
                min(self.vespo_lambda_pos, self.vespo_lambda_neg) > 0,
                "vespo_lambda_pos and vespo_lambda_neg must be > 0",
            ),
            (self.beta >= 0, "beta must be >= 0 (0 disables the KL term)"),
            (self.entropy_coef >= 0, "entropy_coef must be >= 0"),
            (
                0 <= self.top_entropy_quantile <= 1,
                "top_entropy_quantile must be in [0, 1] (1 keeps every token)",
            ),
            (self.entropy_coef_min >= 0, "entropy_coef_min must be >= 0"),
            (self.entropy_coef_max >= self.entropy_coef_min, "entropy_coef_max must be >= entropy_coef_min"),
            (self.entropy_coef_delta > 0, "entropy_coef_delta must be > 0"),
            (self.entropy_target >= 0, "entropy_target must be >= 0 (nats)"),
            (
                self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
                "off_policy_mask_threshold must be >= 0 (a divergence; None turns the mask off)",
            ),
            (self.sampler_is_cap is None or self.sampler_is_cap > 0, "sampler_is_cap must be > 0"),
            (
                self.vllm_importance_sampling_clip_max is None or self.vllm_importance_sampling_clip_max > 0,
                "vllm_importance_sampling_clip_max must be > 0 (or None: no upper bound)",
            ),
            (
                self.vllm_importance_sampling_clip_min is None or self.vllm_importance_sampling_clip_min >= 0,
                "vllm_importance_sampling_clip_min must be >= 0 (or None: no lower bound)",
            ),
            (self.target_kl is None or self.target_kl > 0, "target_kl must be > 0"),
            (self.target_kl is None or self.beta > 0, "target_kl needs beta > 0 as the controller's start"),
            (self.kl_horizon >= 1, "kl_horizon must be >= 1"),
            (0 <= self.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha must be in [0, 1]"),
            (self.ref_model_sync_steps >= 1, "ref_model_sync_steps must be >= 1"),
            (not (self.sync_ref_model and self.beta == 0), "sync_ref_model needs beta > 0 (a reference)"),
            (self.max_nonfinite_steps >= 1, "max_nonfinite_steps must be >= 1"),
            (
                self.max_dynamic_sampling_rounds >= 1,
                "max_dynamic_sampling_rounds must be >= 1 (it caps the extra generation rounds of "
                "dynamic_sampling; set dynamic_sampling=False to generate no extra rounds)",
            ),
            (self.reward_weights is None or len(self.reward_weights) > 0, "reward_weights must not be empty"),
            (
                self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
                "max_tool_calling_iterations must be >= 0 (or None: no limit)",
            ),
            (self.tool_timeout > 0, "tool_timeout must be > 0 seconds"),
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
        for ok, message in checks:
            if not ok:
                raise ValueError(message + ".")

    def check_loss_combinations(self) -> None:
        """Errors for loss and importance-sampling settings that contradict each other, warnings for
        those that do not fit (TRL's, and two of ours); tests that set generation_backend after
        construction run it again."""
        check_sampler_settings(self)
        for warning in loss_type_warnings(self):
            logger.warning(warning)

    def _resolve_generation_batch(self) -> None:
        """Derive steps_per_generation and generation_batch_size from each other; check divisibility."""
        per_round = self.per_device_train_batch_size * self.world_size
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ValueError("Set steps_per_generation or generation_batch_size, not both.")
        if self.generation_batch_size is not None:
            if self.generation_batch_size % per_round:
                raise ValueError(
                    f"generation_batch_size={self.generation_batch_size} must be a multiple of "
                    f"per_device_train_batch_size * num_processes = {per_round}."
                )
            self.steps_per_generation = self.generation_batch_size // per_round
        elif self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.steps_per_generation < 1:
            raise ValueError("steps_per_generation must be >= 1.")
        if (
            self.steps_per_generation > self.gradient_accumulation_steps
            and self.steps_per_generation % self.gradient_accumulation_steps
        ):
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation} must be a multiple of "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} (each optimizer step then "
                "takes whole micro-batches of one round); change steps_per_generation or generation_batch_size."
            )
        self.generation_batch_size = per_round * self.steps_per_generation
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"The generation batch ({self.generation_batch_size} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {self.world_size} processes x steps_per_generation "
                f"{self.steps_per_generation}) must be divisible by num_generations={self.num_generations}; "
                "change per_device_train_batch_size, steps_per_generation or num_generations."
            )


def default_output_dir(model: object) -> str:
    """TRL's output_dir when GRPOTrainer gets no args: '<model name>-GRPO' (the last part of a model id
    or path, or of a model object's `name_or_path`)."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or type(model).__name__
    return f"{str(name).rstrip('/').split('/')[-1]}-GRPO"
