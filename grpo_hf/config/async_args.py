"""The async GRPO settings of `GRPOConfig`: generation overlapped with training on a vLLM server.
TRL's names and meanings (TRL 1.18's `AsyncGRPOConfig`); where grpo-hf departs from TRL, the help
says so. `max_staleness=0` (the default) is synchronous training, as before these settings; >= 1
turns async GRPO on (`episodes.async_rounds`; docs/async-grpo.md).

`GRPOConfig` inherits these fields and calls `check_async_settings` in its `__post_init__`, after
the generation backend and the generation batch are resolved.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from grpo_hf.config.checks import check_ranges


@dataclass
class AsyncArguments:
    """When generation may run ahead of the optimizer, and how far (see the module docstring)."""

    _help_section: ClassVar[tuple[str, str]] = (
        "async",
        "GRPO, async: generation ahead of the optimizer on a vLLM server",
    )

    max_staleness: int = field(
        default=0,
        metadata={
            "help": "Async GRPO: how many policy versions (weight syncs to the vLLM server) a completion may lag "
            "behind the policy that trains on it; an older round is dropped, counted (sample/dropped_stale_total) "
            "and its prompts sampled again. 0: synchronous training. >= 1: a thread in each process generates "
            "the next rounds on a vLLM server (vllm_mode='server') while the trainer trains; grpo-hf generates "
            "each round from the weights of the sync interval before the one that trains on it, so completions "
            "lag by 0 or 1 version (docs/async-grpo.md)."
        },
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "Async GRPO: optimizer steps between weight syncs to the vLLM server (each sync is a new "
            "policy version). Needs max_staleness >= 1."
        },
    )
    max_inflight_tasks: int = field(
        default=-1,
        metadata={
            "help": "Async GRPO: generation requests each process's generation thread keeps in flight at most "
            "(one request per distinct prompt of a round, n = its rows); -1: up to 32, as synchronous server mode."
        },
    )
    queue_maxsize: int = field(
        default=1024,
        metadata={
            "help": "Async GRPO: completions (over all processes) generated ahead of the trainer at most. "
            "Generation reads ahead whole rounds of generation_batch_size completions, so it must be at least "
            "generation_batch_size."
        },
    )
    heartbeat_stale_after_s: float = field(
        default=300.0,
        metadata={
            "help": "Async GRPO: seconds the trainer waits on the generation thread with nothing coming back (no "
            "answer from the vLLM server, no round made) before it stops with an error (a stuck server or "
            "reward function)."
        },
    )

    def check_async_settings(self) -> None:
        """Ranges, and async GRPO's needs: generation on a vLLM server (other devices) and whole rounds
        in the queue. Runs after the generation backend and generation_batch_size are resolved."""
        check_ranges(
            [
                (self.max_staleness >= 0, "max_staleness must be >= 0 (0: synchronous training)"),
                (self.weight_sync_steps >= 1, "weight_sync_steps must be >= 1"),
                (
                    self.max_inflight_tasks == -1 or self.max_inflight_tasks >= 1,
                    "max_inflight_tasks must be >= 1, or -1 (up to 32 requests at once)",
                ),
                (self.heartbeat_stale_after_s > 0, "heartbeat_stale_after_s must be > 0 seconds"),
            ]
        )
        if self.max_staleness == 0:
            check_ranges(
                [
                    (
                        self.weight_sync_steps == 1,
                        f"weight_sync_steps={self.weight_sync_steps} applies to async GRPO only (synchronous "
                        "training samples each round from the current policy); set max_staleness >= 1, or "
                        "weight_sync_steps=1",
                    )
                ]
            )
            return
        if not self.use_vllm or self.vllm_mode != "server":
            backend = (
                f"vllm_mode={self.vllm_mode!r}" if self.use_vllm else "use_vllm=False (grpo-hf's decoder)"
            )
            raise ValueError(
                f"max_staleness={self.max_staleness} (async GRPO) overlaps generation with training, which needs "
                f"generation on other devices: a vLLM server. With {backend} generation shares the device with "
                "training, so there is nothing to overlap. Set use_vllm=True and vllm_mode='server' "
                "(docs/async-grpo.md), or max_staleness=0."
            )
        check_ranges(
            [
                (
                    self.queue_maxsize >= self.generation_batch_size,
                    f"queue_maxsize={self.queue_maxsize} is smaller than one generation round "
                    f"(generation_batch_size={self.generation_batch_size} completions), and generation reads "
                    "ahead whole rounds; raise queue_maxsize",
                ),
            ]
        )
