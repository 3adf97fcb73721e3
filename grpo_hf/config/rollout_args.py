"""The rollout settings of `GRPOConfig`: what one generation round is made of. The prompts (data,
padding, chat templates), the sampling, the batch geometry (`steps_per_generation`,
`generation_batch_size`), the rewards and advantages, dynamic sampling and tool calls. Names and
meanings are TRL 1.16's where TRL has the setting.

Batch sizes count completions, not prompts: `per_device_train_batch_size=8` with
`num_generations=4` trains on two prompts' groups per device and micro-step. One generation round
produces `generation_batch_size` completions across all processes and feeds
`steps_per_generation` micro-steps, `num_iterations` times over (the seeds' "ppo_epochs").

`GRPOConfig` inherits these fields and calls `_resolve_rollout_settings`, `_check_rollout_settings`
and `_resolve_generation_batch` in its `__post_init__`.
"""

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from grpo_hf.algorithm.advantages import AGGREGATIONS
from grpo_hf.config.checks import check_choices, check_dicts, check_ranges

SCALE_REWARDS = ("group", "batch", "none")
REWARD_ERROR_POLICIES = ("raise", "retry", "zero")


@dataclass
class RolloutArguments:
    """What one generation round samples and how it is scored (see the module docstring)."""

    _help_section: ClassVar[tuple[str, str]] = (
        "rollout",
        "GRPO, rollout: data, sampling, batch geometry, rewards, dynamic sampling, tools",
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
        metadata={
            "help": "Micro-steps fed by one generation round; default gradient_accumulation_steps, of which it "
            "must be a multiple or a divisor."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation round over all processes; alternative to steps_per_generation."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Exclude truncated completions from the loss (DAPO's overlong filtering): as in TRL, those "
            "that end without EOS, i.e. hit max_completion_length or, with vLLM, stopped at a `stop` string "
            "of generation_kwargs."
        },
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
    environment_timeout: float = field(
        default=60.0,
        metadata={
            "help": "Seconds an environment's reset(**row) or get_reward() may take (environment_factory=; TRL "
            "has no limit). Past it the call is abandoned and a TimeoutError names the method: a reset stops "
            "the run, a get_reward fails as a reward function does (reward_error_policy). Raise it for "
            "environments that start a sandbox or container in reset."
        },
    )

    def _resolve_rollout_settings(self) -> None:
        """TRL's booleans for scale_rewards, num_generations_eval's default, pad_to_multiple_of and
        chat_template_kwargs from their command-line strings; unsupported batching."""
        as_text = str(self.scale_rewards).lower()  # True -> 'group', False -> 'none' (also as strings)
        self.scale_rewards = {"true": "group", "false": "none"}.get(as_text, self.scale_rewards)
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            warnings.warn(
                f"scale_rewards={self.scale_rewards!r} has no effect with multi_objective_aggregation="
                "'normalize_then_sum': each reward is normalised within its group and their sum over the batch.",
                stacklevel=3,
            )
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.strip().lower()
            if text not in ("none", "null") and not text.isdigit():
                raise ValueError(
                    f"pad_to_multiple_of={self.pad_to_multiple_of!r}: give a positive integer, 'auto' or None."
                )
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.pad_to_multiple_of == "auto":  # Neuron compiles once per input shape
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        check_dicts(self, ["chat_template_kwargs"])
        self.chat_template_kwargs = dict(self.chat_template_kwargs or {})
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size is not supported: it halves per_device_train_batch_size on out-of-memory, "
                "and then a generation batch no longer holds whole groups of num_generations completions. Set "
                "auto_find_batch_size=False and lower per_device_train_batch_size (and raise "
                "gradient_accumulation_steps) instead."
            )

    def _check_rollout_settings(self) -> None:
        """Each rollout setting among its allowed values and within its range."""
        check_choices(
            self,
            (
                ("scale_rewards", SCALE_REWARDS),
                ("multi_objective_aggregation", AGGREGATIONS),
                ("reward_error_policy", REWARD_ERROR_POLICIES),
            ),
        )
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
            (self.max_completion_length >= 1, "max_completion_length must be >= 1"),
            (self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length must be >= 1"),
            (self.temperature > 0, "temperature must be > 0 (log-probs divide by it)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.min_p is None or 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
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
            (self.environment_timeout > 0, "environment_timeout must be > 0 seconds"),
        ]
        check_ranges(checks)

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
        check_steps_fit_rounds(self.steps_per_generation, self.gradient_accumulation_steps)
        self.generation_batch_size = per_round * self.steps_per_generation
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"The generation batch ({self.generation_batch_size} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {self.world_size} processes x steps_per_generation "
                f"{self.steps_per_generation}) must be divisible by num_generations={self.num_generations}; "
                "change per_device_train_batch_size, steps_per_generation or num_generations."
            )

    @property
    def policy_moves_within_round(self) -> bool:
        """The policy may move while a generation round is consumed (several passes over it, or
        several optimizer steps per pass): its micro-batches need their old log-probs."""
        return self.num_iterations > 1 or self.steps_per_generation > self.gradient_accumulation_steps

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


def check_steps_fit_rounds(steps_per_generation: int, accumulation: int) -> None:
    """An optimizer step takes whole micro-batches of one generation round (steps_per_generation a
    multiple of gradient_accumulation_steps) or whole rounds (the other way round). Other pairs (TRL
    takes them) make optimizer steps straddle rounds, and a step's loss is a token mean neither over
    its own tokens nor over whole rounds (`loss.dapo_normalizers`)."""
    low, high = sorted((steps_per_generation, accumulation))
    if high % low == 0:
        return
    divisor = max(d for d in range(1, steps_per_generation + 1) if accumulation % d == 0)
    multiple = -(-steps_per_generation // accumulation) * accumulation
    raise ValueError(
        f"steps_per_generation={steps_per_generation} and gradient_accumulation_steps={accumulation} must "
        "divide one another, so that an optimizer step takes whole micro-batches of one generation round or "
        f"whole rounds; set steps_per_generation to {divisor} or {multiple} (generation_batch_size: that times "
        "per_device_train_batch_size x processes), or change gradient_accumulation_steps."
    )
