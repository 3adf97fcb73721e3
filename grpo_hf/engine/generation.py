"""The one interface generation goes through: "completions of these prompts" and "new weights".

The trainer holds one `Generator`, made by `build_generator` (the only place a backend is chosen),
and calls `generate(prompt_ids, prompt_mask, sampling, policy_version)`. `policy_version` is the
trainer's optimizer step: before the first call of a new version the generator takes the policy's
weights (`load_policy`: refresh the generation copy, push to vLLM), and at no other time, so a
multi-turn episode's turns and dynamic sampling's extra rounds reuse what the round's first call
loaded.

Backends:
- `LocalGenerator`: in the training process, on the policy or its `GenerationCopy`, through our
  decoding loop (`rollout.generate`), transformers' `generate` (`cache_implementation`, or
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from accelerate import Accelerator
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from grpo_hf import rollout
from grpo_hf.engine import transformers_generate
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.reference import is_peft_model
from grpo_hf.rollout import Rollout
from grpo_hf.sharding import unsharded_for_generation


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

    def generation_config(self) -> GenerationConfig:
        """As a transformers GenerationConfig (our decoder, generate, continuous batching)."""
        return rollout.generation_config(
            max_completion_length=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            generation_kwargs=self.generation_kwargs,
        )


def empty_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Rollout:
    """The rollout of zero rows (a process with nothing to generate in a collective call)."""
    nothing = torch.zeros((0, 0), dtype=torch.long, device=prompt_ids.device)
    return rollout.Rollout(
        prompt_ids, prompt_mask, nothing, nothing, torch.zeros(0, dtype=torch.bool, device=nothing.device),
        torch.zeros((0, 0), device=nothing.device),
    )  # fmt: skip


class Generator(ABC):
    """Completions from the current policy; weights taken once per policy version."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.version: int | None = None  # policy version whose weights the backend holds
        self.calls = 0  # generate calls since then (vLLM derives its request seeds from it)
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
        if policy_version != self.version:
            self.load_policy()
            self.version, self.calls = policy_version, 0
        self.calls += 1
        return self._generate(prompt_ids, prompt_mask, sampling)

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
        """Remove what the backend keeps on disk between weight updates (a server's last weight file);
        called when training ends. The next call takes the policy's weights as usual."""
        return None  # the local and colocate backends keep nothing

    @abstractmethod
    def load_policy(self) -> None:
        """Take the policy's current weights."""

    @abstractmethod
    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Rollout:
        """The backend's completions."""


class LocalGenerator(Generator):
    """Generation in the training process, on the policy or its `GenerationCopy`.

    `method`: 'decoder' (our decoding loop; `decoder` is generation_backend's choice of decoder),
    'generate' (transformers' generate) or 'continuous_batching' (transformers' generate_batch).
    `gather` (`ds3_gather_for_generation`): under ZeRO-3, gather the whole model for generation;
    False decodes with it partitioned, every process in lockstep (`sharding.unsharded_for_generation`).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        policy: Callable[[], nn.Module],
        copy: GenerationCopy | None,
        method: str = "decoder",
        decoder: str = "auto",
        batching_kwargs: dict | None = None,
        sharded: bool = False,
        gather: bool = True,
    ):
        super().__init__(accelerator)
        self.policy, self.copy, self.method, self.decoder = policy, copy, method, decoder
        self.batching_kwargs, self.sharded, self.gather = batching_kwargs or {}, sharded, gather

    @property
    def collective(self) -> bool:
        return self.sharded  # whole parameters are gathered around each call

    def load_policy(self) -> None:
        if self.copy is not None:
            self.copy.refresh()

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Rollout:
        model = self.copy.model if self.copy is not None else self.policy()
        config = sampling.generation_config()
        with unsharded_for_generation(model, self.accelerator, self.gather) as all_done:
            if prompt_ids.shape[0] == 0:
                if all_done is not None:  # in lockstep every process decodes until all are done
                    spare = torch.full((1, 1), sampling.pad_token_id, device=prompt_ids.device)
                    rollout.generate(model, spare, torch.ones_like(spare), config, self.decoder, all_done)
                return empty_rollout(prompt_ids, prompt_mask)
            if self.method == "generate":
                return transformers_generate.with_generate(model, prompt_ids, prompt_mask, config)
            if self.method == "continuous_batching":
                return transformers_generate.with_continuous_batching(
                    model, prompt_ids, prompt_mask, config, self.batching_kwargs
                )
            return rollout.generate(model, prompt_ids, prompt_mask, config, self.decoder, all_done)


def sampling_settings(args, eos_token_ids: list[int], pad_token_id: int) -> Sampling:
    """The run's `Sampling`, from its settings (cache_implementation joins the GenerationConfig keys)."""
    extra = dict(args.generation_kwargs)
    if args.cache_implementation is not None:
        extra["cache_implementation"] = args.cache_implementation
    return Sampling(
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        generation_kwargs=extra,
        seed=args.seed,
    )


def local_method(args) -> str:
    """Which local engine the settings ask for: continuous batching, transformers' generate (a cache
    implementation, or generation_kwargs our decoding loop does not implement), or our decoder."""
    if args.use_transformers_continuous_batching:
        return "continuous_batching"
    if args.cache_implementation is not None or set(args.generation_kwargs) - rollout.DECODER_KEYS:
        return "generate"
    return "decoder"


def generation_copy_for(args, model: nn.Module, sharded: bool, method: str) -> GenerationCopy | None:
    """A plain copy to sample from: in generation_dtype (or bf16 under --bf16), and with LoRA always.

    With LoRA the copy holds the adapters merged, so a Llama decodes through `LlamaDecoder` on
    plain weights instead of the PEFT model's forward (a float32 round of the bench workload on an
    AVX2 CPU: see README); it costs one more copy of the weights in that dtype.
    """
    if sharded and args.generation_dtype is not None:
        raise ValueError(
            "generation_dtype needs the whole model on each process; unset it under FSDP/DeepSpeed."
        )
    if sharded:
        return None
    model_dtype = next(model.parameters()).dtype
    name = args.generation_dtype or ("bfloat16" if args.bf16 else None)
    dtype = getattr(torch, name) if name else model_dtype
    if dtype == model_dtype and not is_peft_model(model):
        return None
    return GenerationCopy(model, dtype, decode_attention=method != "continuous_batching")


def build_generator(
    args,
    accelerator: Accelerator,
    model: nn.Module,
    policy: Callable[[], nn.Module],
    tokenizer: PreTrainedTokenizerBase,
    sharded: bool,
) -> Generator:
    """The run's generator: the one place a backend is chosen. `model` is the policy as built (before
    Accelerate wraps it), `policy()` the trainer's current unwrapped policy, `sharded` whether FSDP
    or DeepSpeed holds its parameters."""
    if args.generation_backend == "vllm":
        from grpo_hf.engine.vllm import vllm_generator

        return vllm_generator(args, accelerator, model, policy, tokenizer)
    method = local_method(args)
    if not args.ds3_gather_for_generation and method != "decoder":
        raise ValueError(
            "ds3_gather_for_generation=False decodes through our decoder only; unset cache_implementation, "
            "use_transformers_continuous_batching and the generation_kwargs it does not implement "
            f"({sorted(set(args.generation_kwargs) - rollout.DECODER_KEYS)}), or set ds3_gather_for_generation=True."
        )
    return LocalGenerator(
        accelerator,
        policy,
        generation_copy_for(args, model, sharded, method),
        method=method,
        decoder=args.generation_backend,
        batching_kwargs=args.transformers_continuous_batching_config,
        sharded=sharded,
        gather=args.ds3_gather_for_generation,
    )
