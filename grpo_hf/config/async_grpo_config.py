"""`AsyncGRPOConfig`: TRL 1.18's async GRPO configuration, so that a TRL async GRPO script runs with
its import line changed. It is `GRPOConfig` with TRL's async defaults: async GRPO on
(max_staleness=4), generation on a vLLM server at http://localhost:8000 (TRL's async trainer has no
other mode), max_completion_length=2048, a log every step, a constant learning rate and 3
completions printed when log_completions is on. Every
`GRPOConfig` setting is accepted too; `GRPOTrainer` and `AsyncGRPOTrainer` train with it alike.

TRL's `request_timeout` is grpo-hf's `vllm_server_request_timeout`. `token_budget` is `GRPOConfig`'s:
it cuts the old and reference log-prob passes by tokens (TRL's async trainer also batches its
training rows by it; grpo-hf's micro-batches stay `per_device_train_batch_size` rows). TRL defaults
it to the vLLM server's max_model_len; here None keeps one pass per micro-batch.
`fork_threshold_tokens` (TRL's multi-turn row reconciliation) is accepted and has no effect:
grpo-hf keeps a multi-turn episode one row.
"""

from dataclasses import dataclass, field

from grpo_hf.config.grpo_config import GRPOConfig, default_output_dir


def _help(name: str) -> dict:
    """GRPOConfig's help text of `name` (a default overridden here keeps its one description)."""
    return GRPOConfig.__dataclass_fields__[name].metadata


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """`GRPOConfig` with TRL's async GRPO defaults (see the module docstring)."""

    max_staleness: int = field(default=4, metadata=_help("max_staleness"))
    use_vllm: bool = field(default=True, metadata=_help("use_vllm"))
    vllm_mode: str = field(default="server", metadata=_help("vllm_mode"))
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000", metadata=_help("vllm_server_base_url")
    )
    max_completion_length: int = field(default=2048, metadata=_help("max_completion_length"))
    logging_steps: float = field(default=1, metadata=_help("logging_steps"))
    lr_scheduler_type: str = field(default="constant", metadata=_help("lr_scheduler_type"))
    num_completions_to_print: int | None = field(default=3, metadata=_help("num_completions_to_print"))
    request_timeout: float | None = field(
        default=None, metadata={"help": "TRL's name for vllm_server_request_timeout; sets it when given."}
    )
    fork_threshold_tokens: int = field(
        default=1024,
        metadata={
            "help": "Accepted for TRL scripts, no effect: a multi-turn episode stays one row in grpo-hf."
        },
    )

    def __post_init__(self) -> None:
        if self.request_timeout is not None:
            self.vllm_server_request_timeout = self.request_timeout
        super().__post_init__()
        if self.max_staleness < 1:
            raise ValueError(
                f"AsyncGRPOConfig(max_staleness={self.max_staleness}) would train synchronously: async GRPO needs "
                "max_staleness >= 1. Use GRPOConfig (and GRPOTrainer) for synchronous training."
            )


def trl_async_arguments(positional: tuple, named: dict) -> dict:
    """`AsyncGRPOTrainer`'s arguments by name: the positional ones in TRL 1.18's order (model,
    reward_funcs, args, train_dataset, processing_class, callbacks, optimizers, tools,
    environment_factory); args default to an `AsyncGRPOConfig` whose output_dir is
    '<model name>-AsyncGRPO' (TRL's), and must be async (max_staleness >= 1)."""
    order = (
        "model", "reward_funcs", "args", "train_dataset", "processing_class", "callbacks", "optimizers", "tools",
        "environment_factory",
    )  # fmt: skip
    if len(positional) > len(order):
        raise TypeError(
            f"AsyncGRPOTrainer takes at most {len(order)} positional arguments ({', '.join(order)})."
        )
    twice = sorted(set(order[: len(positional)]) & set(named))
    if twice:
        raise TypeError(f"AsyncGRPOTrainer got {twice} both by position and by name.")
    arguments = dict(zip(order[: len(positional)], positional, strict=True)) | named
    if arguments.get("args") is None:
        arguments["args"] = AsyncGRPOConfig(
            output_dir=default_output_dir(arguments.get("model"), "AsyncGRPO")
        )
    if arguments["args"].max_staleness < 1:
        raise ValueError(
            f"AsyncGRPOTrainer trains async GRPO, and args has max_staleness={arguments['args'].max_staleness}: "
            "set max_staleness >= 1 (AsyncGRPOConfig's default is 4), or use GRPOTrainer for synchronous training."
        )
    return arguments
