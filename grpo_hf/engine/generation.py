"""The one interface generation goes through: "completions of these prompts" and "new weights".

The trainer holds one `Generator`, made by `backends.build_generator` (the only place a backend is
chosen), and calls `generate(prompt_ids, prompt_mask, sampling, policy_version)`. `policy_version` is the
trainer's optimizer step: before the first call of a new version the generator takes the policy's
weights (`load_policy`: refresh the generation copy, push to vLLM), so a multi-turn episode's turns
and dynamic sampling's extra rounds reuse what the round's first call loaded. Weights that change
outside an optimizer step (a checkpoint loaded when training starts; the best model loaded, or in
async GRPO the steps after the last weight sync, when it ends) are taken by the first call after
`weights_changed`, whatever its version: `around_training` says so around `train()`.

Backends:
- `local.LocalGenerator`: in the training process, on the policy or its `GenerationCopy`, through
  our decoding loop (`local.generate`), transformers' `generate` (`cache_implementation`, or
  `generation_kwargs` our loop does not implement) or its continuous batching
  (`use_transformers_continuous_batching`) (`transformers_generate`).
- vLLM (`generation_backend="vllm"`): `vllm.colocate.ColocateGenerator` (an engine in each training
  process) or `vllm.server.ServerGenerator` (a separately started server).

A collective generator needs every process in every call (a server round gathers the prompts of
all processes; sharded weights are all-gathered): `any_active` lets a loop whose length differs
between processes (multi-turn episodes) keep calling with no rows until every process is done, and
`uneven_calls` does the same for code that does not know it (a user's `rollout_func`).
"""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from accelerate import Accelerator

from grpo_hf.data.rollout import Rollout


@dataclass(frozen=True)
class Sampling:
    """What one generation call samples: the run's sampling settings."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float | None
    repetition_penalty: float
    eos_token_ids: list[int]
    pad_token_id: int
    generation_kwargs: dict = field(default_factory=dict)  # backend-specific extras, overriding the above
    seed: int = 0  # vLLM: per-request seeds derive from it

    def with_max_new_tokens(self, max_new_tokens: int) -> "Sampling":
        return replace(self, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class VLLMSettings:
    """What the vLLM backends take of a run's settings, under `GRPOConfig`'s names (`vllm_base_url`
    and `vllm_weights_folder` resolved); `max_num_seqs` is a colocated engine's batch (the rows of a
    round per tensor-parallel group), `model_copy_dir` where it saves a policy that has no checkpoint
    folder or hub id, `revision` / `trust_remote_code` how it loads one that has."""

    vllm_mode: str
    vllm_base_url: str
    vllm_server_timeout: float
    vllm_server_request_timeout: float
    vllm_weight_sync: str
    vllm_weights_folder: str
    vllm_group_port: int
    vllm_structured_outputs_regex: str | None
    vllm_tensor_parallel_size: int
    vllm_gpu_memory_utilization: float
    vllm_max_model_length: int | None
    vllm_kv_cache_memory_bytes: int | None
    vllm_enforce_eager: bool
    vllm_enable_sleep_mode: bool
    vllm_model_impl: str
    vllm_engine_kwargs: dict | None
    max_num_seqs: int
    model_copy_dir: str
    run_name: str  # names the run's LoRA adapters on a server (`weights.run_identity`)
    trust_remote_code: bool
    revision: str | None


@dataclass(frozen=True)
class GenerationSettings:
    """What the engine takes of a run's settings, under `GRPOConfig`'s names:
    `GRPOConfig.generation_settings()` builds it once; the engine never reads the config."""

    generation_backend: str  # 'vllm', or our decoder's choice (`decoding.DECODERS`)
    generation_dtype: str | None
    rollout_quantization: str | None  # 'int8': the generation copy's weights in int8 (`quantization`)
    bf16: bool
    cache_implementation: str | None
    generation_kwargs: dict
    use_transformers_continuous_batching: bool
    transformers_continuous_batching_config: dict | None
    ds3_gather_for_generation: bool
    seed: int
    vllm: VLLMSettings | None  # with generation_backend='vllm'


class Generator(ABC):
    """Completions from the current policy; weights taken once per policy version."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.version: int | None = None  # policy version whose weights the backend holds
        self.calls = 0  # generate calls since then (vLLM derives its request seeds from it)
        self._changed = False  # the policy's weights changed since they were taken (`weights_changed`)
        self._uneven = False  # inside `uneven_calls`

    @property
    def collective(self) -> bool:
        """Whether every process must take part in every call."""
        return False

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, policy_version: int
    ) -> Rollout:
        """One completion per (B, P) left-padded prompt row (rows already repeat each prompt G times)."""
        if self._uneven:
            self.any_active(True)  # the processes done with their calls join this one (`uneven_calls`)
        return self._generate_with_version(prompt_ids, prompt_mask, sampling, policy_version)

    def _generate_with_version(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, policy_version: int
    ) -> Rollout:
        self.sync(policy_version)
        self.calls += 1
        return self._generate(prompt_ids, prompt_mask, sampling)

    def sync(self, version: int) -> bool:
        """Take the policy's weights as policy version `version` unless the backend holds that version's
        and they have not changed since (`weights_changed`); whether it took them (collective where the
        generator is). The same version taken again goes on counting its calls, so vLLM's request seeds
        do not repeat."""
        if version == self.version and not self._changed:
            return False
        self.load_policy(version)
        if version != self.version:
            self.calls = 0
        self.version, self._changed = version, False
        return True

    def weights_changed(self) -> None:
        """The policy's weights changed outside an optimizer step: the next call takes them,
        whatever its policy version."""
        self._changed = True

    @contextmanager
    def around_training(self) -> Iterator[None]:
        """Around `Trainer.train`, which changes the weights outside an optimizer step: it loads a
        checkpoint before the first step, and the best model after the last (load_best_model_at_end);
        async GRPO sends no weights after its last weight sync. So the first call inside and the
        first call after take the policy's weights whatever the version; on the way out, `close`."""
        self.weights_changed()
        try:
            yield
        finally:
            self.close()
            self.weights_changed()

    def any_active(self, active: bool) -> bool:
        """Whether any process still has rows to generate (this one: `active`). Every process calls it."""
        if not self.collective or self.accelerator.num_processes == 1:
            return active
        flag = torch.tensor([float(active)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum").item() > 0)

    @contextmanager
    def uneven_calls(self, sampling: Sampling, policy_version: int) -> Iterator[None]:
        """Within, processes may call `generate` different numbers of times (a rollout_func's own
        turns). With a collective generator each call first tells the others it is made
        (`any_active`); a process leaving the block joins the others' remaining calls with no rows
        (with `sampling` and `policy_version`, those of the calls inside) until every process has
        left it. An error inside leaves at once (the other processes then stop at the launcher)."""
        if not self.collective or self.accelerator.num_processes == 1:
            yield
            return
        self._uneven = True
        try:
            yield
        finally:
            self._uneven = False
        nothing = torch.zeros((0, 0), dtype=torch.long, device=self.accelerator.device)  # (0, 0) no rows
        while self.any_active(False):
            self._generate_with_version(nothing, nothing, sampling, policy_version)

    def close(self) -> None:
        """Remove what the backend keeps between weight updates (a server's last weight file or
        adapter); called when training ends (`around_training`, after which the next call takes the
        policy's weights)."""
        return None  # the local and colocate backends keep nothing

    @abstractmethod
    def load_policy(self, version: int) -> None:
        """Take the policy's current weights, policy version `version`."""

    @abstractmethod
    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Rollout:
        """The backend's completions."""
