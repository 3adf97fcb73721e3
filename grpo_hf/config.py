"""`GRPOConfig`: the GRPO settings, on top of `transformers.TrainingArguments`.

Batch sizes count completions, not prompts: `per_device_train_batch_size=8` with
`num_generations=4` trains on two prompts' groups per device and micro-step. One generation round
produces `generation_batch_size` completions across all processes and feeds
`steps_per_generation` micro-steps, `num_iterations` times over (the seeds' "ppo_epochs").
"""

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from grpo_hf.config_generation import GenerationBackendArguments
from grpo_hf.engine import native_bf16
from grpo_hf.engine.decoding import DECODERS

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
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

    _VALID_DICT_FIELDS = [
        *TrainingArguments._VALID_DICT_FIELDS,
        "generation_kwargs",
        "transformers_continuous_batching_config",
        "vllm_engine_kwargs",
    ]

    # ---- Overridden TrainingArguments defaults -------------------------------------------------
    learning_rate: float = field(
        default=1e-6, metadata={"help": "AdamW learning rate (1e-6 as in DeepSeekMath)."}
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep dataset columns: they reach the reward functions."}
    )

    # ---- Data and generation -------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (G)."})
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Prompts longer than this many tokens keep their last tokens (with a warning)."},
    )
    max_completion_length: int = field(default=256, metadata={"help": "Maximum new tokens per completion."})
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
    scale_rewards: str = field(
        default="group",
        metadata={"help": "Advantage scale: 'group' std (DeepSeekMath), 'batch' std, or 'none' (Dr. GRPO)."},
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
            "help": "Turns whose tool calls are answered per episode; a call after that is left unanswered and "
            "the episode ends. None: no limit but max_completion_length, which counts model and tool tokens."
        },
    )
    tool_timeout: float = field(
        default=10.0,
        metadata={
            "help": "Seconds a tool call may take; after that the model gets an error message instead."
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
            "help": "Aggregation: 'grpo' (per-sequence mean), 'bnpo' (micro-batch token mean), "
            "'dr_grpo' (sum / (B * max_completion_length)), 'dapo' (token mean over all the tokens, on every "
            "process, that feed one optimizer step)."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "'token' ratios (GRPO) or one ratio per sequence (GSPO, arXiv 2507.18071)."},
    )
    sampler_is_cap: float | None = field(
        default=None,
        metadata={
            "help": "Truncated importance sampling (token level): weight each token's policy term by "
            "min(pi_old / pi_sampler, cap), correcting for the sampler (bf16 copy, top_p ...) drawing from "
            "another distribution than the policy's; e.g. 2.0. Off by default. The ratio is logged as "
            "'sampler/ratio_mean' and 'sampler/ratio_max' either way."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={"help": "Entropy bonus coefficient (arXiv 2504.20571): loss -= coef * entropy."},
    )

    # ---- KL to the reference -------------------------------------------------------------------
    beta: float = field(
        default=0.04, metadata={"help": "KL coefficient (0.04 in DeepSeekMath); 0 loads no reference model."}
    )
    kl_estimator: str = field(
        default="k3", metadata={"help": "KL estimator: 'k1', 'k2' or 'k3' (Schulman's approximations)."}
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
        default=False, metadata={"help": "Log a table of sample completions with their rewards."}
    )
    num_completions_to_print: int = field(default=4, metadata={"help": "Rows of the completions table."})
    max_nonfinite_steps: int = field(
        default=3, metadata={"help": "Stop after this many non-finite losses in a row (each is skipped)."}
    )

    def __post_init__(self) -> None:
        self._resolve_precision()
        super().__post_init__()
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        self._check_choices()
        self._check_ranges()
        self._resolve_generation_batch()
        self.check_generation_settings()
        if self.eval_strategy != "no" or self.do_eval:
            self.check_eval_batch()

    def check_eval_batch(self) -> None:
        """Evaluation batches must hold whole groups too (the trainer also calls this, before
        loading the model, when it is given an eval_dataset)."""
        per_step = self.per_device_eval_batch_size * self.world_size
        if per_step % self.num_generations:
            raise ValueError(
                f"The evaluation batch ({per_step} completions = per_device_eval_batch_size "
                f"{self.per_device_eval_batch_size} x {self.world_size} processes) must be divisible by "
                f"num_generations={self.num_generations}; change per_device_eval_batch_size."
            )

    def _resolve_precision(self) -> None:
        """precision -> the --bf16 flag; 'auto' from what the device computes natively."""
        if self.precision is None:
            return
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

    def _check_choices(self) -> None:
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("kl_estimator", KL_ESTIMATORS),
            ("scale_rewards", SCALE_REWARDS),
            ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
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
            (self.delta is None or self.delta > 1 + self.epsilon_high, "delta must be > 1 + epsilon_high"),
            (self.beta >= 0, "beta must be >= 0 (0 disables the KL term)"),
            (self.entropy_coef >= 0, "entropy_coef must be >= 0"),
            (self.sampler_is_cap is None or self.sampler_is_cap > 0, "sampler_is_cap must be > 0"),
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
                self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 1,
                "max_tool_calling_iterations must be >= 1 (or None: no limit)",
            ),
            (self.tool_timeout > 0, "tool_timeout must be > 0 seconds"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message + ".")

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
