"""Server mode: a vLLM server started separately, shared by every training process.

Each generation call is collective. Every process's prompt rows are gathered; process 0 sends each
distinct prompt once (one /v1/completions request with n = its rows, the requests concurrent) and
hands every process back its own rows by the row counts gathered from each, so processes may hold
different numbers of rows (multi-turn episodes: a process whose episodes have ended takes part with
none) and ask for different lengths (the round samples the longest; each process cuts its own).
New weights, once per policy version: whole (gathered under FSDP2 / ZeRO-3), LoRA merged, sent by
process 0 (`weights.FileWeights` or `weights.NcclWeights`), or a LoRA policy's adapter alone
(`weights.AdapterWeights`, vllm_weight_sync='lora': requests then name version v's adapter as
their model, `weights.adapter_name(run, v)`, where `run` is drawn by process 0 for this trainer,
so that runs sharing a server keep their own adapters), then the prefix cache reset.

Whatever process 0 meets (no server, a timeout, a refusal) reaches every process as the same error
(`_on_main`), so no process waits forever for a peer that has failed. The others wait for process 0
in a collective, which fails after `ddp_timeout`: the start (vllm_server_timeout), a generation
round and a weight update (vllm_server_request_timeout each, the round's requests together) are
bounded below it (checked with the settings).

`generate_alone` is the one call that is not collective: a process's own rows, sent by that
process, from whatever weights the server holds (async GRPO's generation thread, which must issue
no collective while the training thread does; `episodes.async_rounds`).
"""

import importlib.util
import logging
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from torch import nn

from grpo_hf.data.rollout import Rollout
from grpo_hf.engine.generation import GenerationSettings, Generator, Sampling
from grpo_hf.engine.vllm.client import VLLMClient
from grpo_hf.engine.vllm.requests import (
    Samples,
    plan_prompts,
    prompt_rows,
    request_seed,
    rollout_from_samples,
    samples_for_rows,
    sampling_fields,
)
from grpo_hf.engine.vllm.weights import (
    AdapterWeights,
    FileWeights,
    NcclWeights,
    adapter_name,
    check_adapter,
    run_identity,
    vllm_weights,
)
from grpo_hf.models.sharding import unsharded_for_generation

logger = logging.getLogger(__name__)

_ERRORS = {error.__name__: error for error in (ConnectionError, TimeoutError, RuntimeError, ValueError)}


class ServerGenerator(Generator):
    """Completions and weight updates through a vLLM server (see the module docstring)."""

    def __init__(
        self,
        settings: GenerationSettings,
        accelerator: Accelerator,
        model: nn.Module,
        policy: Callable[[], nn.Module],
    ):
        super().__init__(accelerator)
        self.settings, self.policy = settings, policy
        self.client = VLLMClient(settings.vllm.vllm_base_url, settings.vllm.vllm_server_request_timeout)
        self.sender: FileWeights | NcclWeights | AdapterWeights | None = None  # process 0's
        self.adapters = self._on_main(self._connect) == "lora"  # requests name the version's adapter
        # The run's adapter names (`model_name`), the same on every process: drawn by process 0.
        self.run = self._on_main(lambda: run_identity(settings.vllm.run_name)) if self.adapters else None

    @property
    def collective(self) -> bool:
        return True

    def _on_main(self, work: Callable[[], object]) -> object:
        """`work()` on process 0; its result, or its error, on every process."""
        outcome, error = None, None
        if self.accelerator.is_main_process:
            try:
                outcome = ("ok", work())
            except Exception as caught:  # any failure reaches the peers: none waits for a broadcast
                kinds = [name for name, error_type in _ERRORS.items() if isinstance(caught, error_type)]
                error, outcome = (
                    caught,
                    ("error", (kinds or ["RuntimeError"])[0], f"{type(caught).__name__}: {caught}"),
                )
        if self.accelerator.num_processes > 1:
            outcome = broadcast_object_list([outcome], from_process=0)[0]
        if error is not None:
            raise error
        if outcome[0] == "error":
            raise _ERRORS[outcome[1]](f"(from process 0) {outcome[2]}")
        return outcome[1]

    def _connect(self) -> str:
        """Wait for the server; check its log-probs; choose how weights reach it (returned)."""
        vllm = self.settings.vllm
        self.client.wait_until_up(vllm.vllm_server_timeout)
        config = self.client.server_config()
        model_config = config["model_config"]
        if model_config["logprobs_mode"] != "processed_logprobs":
            raise ValueError(
                f"The vLLM server at {self.client.base_url} returns {model_config['logprobs_mode']!r} log-probs; "
                "the sampler's log-probs (sampler/ratio_*, the importance-sampling correction) must be those it "
                "sampled from: restart it with --logprobs-mode processed_logprobs."
            )
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        lora = config.get("lora_config")
        mode = vllm.vllm_weight_sync
        if mode == "auto":
            mode = _auto_weight_sync(backend, lora, self.policy)
        if mode == "lora":
            check_adapter(self.policy(), lora)
            self.sender = AdapterWeights(self.client, vllm.vllm_weights_folder)
        elif mode == "nccl":
            if backend != "nccl":
                raise ValueError(
                    "vllm_weight_sync='nccl' needs a server started with --weight-transfer-config "
                    "'{\"backend\": \"nccl\"}'; restart it so, or set vllm_weight_sync='files'."
                )
            self.sender = NcclWeights(self.client, vllm.vllm_group_port)
        else:
            dtype = getattr(torch, str(model_config["dtype"]).removeprefix("torch."))
            self.sender = FileWeights(self.client, vllm.vllm_weights_folder, dtype)
        logger.info(
            "Weights reach the vLLM server at %s as %s (vllm_weight_sync).", self.client.base_url, mode
        )
        return mode

    def close(self) -> None:
        """Remove the last weight file (the server holds its weights), or unload the adapters sent
        (process 0's)."""
        if self.sender is not None:
            self.sender.close()

    def load_policy(self, version: int) -> None:
        model = self.policy()
        with unsharded_for_generation(model, self.accelerator):
            if self.adapters:
                self._on_main(lambda: self.sender.send(model, self.model_name(version)))
            else:
                self._on_main(lambda: self.sender.send(vllm_weights(model)))
        self._on_main(self.client.reset_prefix_cache)

    def model_name(self, version: int | None) -> str | None:
        """The model requests from policy `version` name: its adapter, or None (the served model)."""
        return adapter_name(self.run, version) if self.adapters else None

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Rollout:
        mine = (prompt_rows(prompt_ids, prompt_mask), sampling.max_new_tokens)
        gathered = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        everyone = [rows for rows, _ in gathered]
        # Processes may ask for different lengths (episodes' budgets): the round samples up to the
        # longest a process with rows asked for, and each process cuts its own to its length.
        longest = max((limit for rows, limit in gathered if rows), default=sampling.max_new_tokens)
        round_sampling = sampling.with_max_new_tokens(longest)
        per_process = self._on_main(lambda: self._complete(everyone, round_sampling))
        limit = sampling.max_new_tokens
        samples = [
            (tokens[:limit], logps[:limit]) for tokens, logps in per_process[self.accelerator.process_index]
        ]
        return rollout_from_samples(prompt_ids, prompt_mask, samples, sampling)

    def _complete(self, everyone: list[list[list[int]]], sampling: Sampling) -> list[Samples]:
        """Every process's rows -> one request per distinct prompt -> every process's samples."""
        return complete_rows(
            self.client,
            everyone,
            sampling,
            lambda k: request_seed(sampling.seed, self.version, self.calls, k),
            self.settings.vllm.vllm_structured_outputs_regex,
            max_requests=32,
            model=self.model_name(self.version),
        )

    def generate_alone(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        version: int,
        call: str,
        client: VLLMClient,
        max_requests: int,
    ) -> Rollout:
        """This process's (B, P) rows through `client`, no collective and no weight update: from the
        weights the server holds (policy `version`). Request seeds come from (version, `call`: the
        call's name, never a count as the training thread's calls have, the request's place, this
        process), at most `max_requests` requests at once."""
        process, processes = self.accelerator.process_index, self.accelerator.num_processes
        samples = complete_rows(
            client,
            [prompt_rows(prompt_ids, prompt_mask)],
            sampling,
            lambda k: request_seed(sampling.seed, version, call, k * processes + process),
            self.settings.vllm.vllm_structured_outputs_regex,
            max_requests,
            self.model_name(version),
        )[0]
        return rollout_from_samples(prompt_ids, prompt_mask, samples, sampling)


def complete_rows(
    client: VLLMClient,
    everyone: list[list[list[int]]],
    sampling: Sampling,
    seed: Callable[[int], int],
    regex: str | None,
    max_requests: int,
    model: str | None = None,
) -> list[Samples]:
    """Each process's prompt rows -> one request per distinct prompt (request k seeded `seed(k)`, at
    most `max_requests` at once, all within the client's timeout; naming `model` if given) -> each
    process's samples."""
    prompts, counts, slots = plan_prompts([row for rows in everyone for row in rows])
    named = {} if model is None else {"model": model}
    bodies = [
        {"prompt": prompt, "return_token_ids": True, **named, **sampling_fields(sampling, n, seed(k), regex)}
        for k, (prompt, n) in enumerate(zip(prompts, counts, strict=True))
    ]
    answers = client.complete_all(bodies, max_requests)
    per_row = samples_for_rows([_samples(a, n) for a, n in zip(answers, counts, strict=True)], slots)
    starts = [sum(len(rows) for rows in everyone[:p]) for p in range(len(everyone))]
    return [per_row[start : start + len(rows)] for start, rows in zip(starts, everyone, strict=True)]


def _auto_weight_sync(backend: str | None, lora: dict | None, policy: Callable[[], nn.Module]) -> str:
    """vllm_weight_sync='auto': the adapter alone where the server takes LoRA adapters (`lora`, its
    lora_config) and the policy is a plain LoRA one (TRL's rule: starting the server with
    --enable-lora asks for it); else NCCL where the server offers it, CUDA is here and so is vLLM
    (its weight-transfer client); else files."""
    if lora is not None:
        try:
            check_adapter(policy(), lora)
            return "lora"
        except ValueError as reason:
            logger.warning(
                "The vLLM server takes LoRA adapters, but the merged weights go instead: %s", reason
            )
    if backend != "nccl" or not torch.cuda.is_available():
        return "files"
    if importlib.util.find_spec("vllm") is None:
        logger.warning(
            "The vLLM server offers NCCL weight transfer, but vLLM (its weight-transfer client) is not installed "
            "here: new weights go as files to vllm_weight_sync_dir, which the server must read at the same path. "
            "Install vLLM here to send them over NCCL, or set vllm_weight_sync='files'."
        )
        return "files"
    return "nccl"


def _samples(answer: dict, n: int) -> Samples:
    """The n samples of one /v1/completions answer, in order: token ids and their log-probs."""
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    if len(choices) != n:
        raise RuntimeError(f"The vLLM server returned {len(choices)} completions for a prompt, not {n}.")
    samples = []
    for choice in choices:
        logps = choice["logprobs"]["token_logprobs"]
        if any(value is None for value in logps):
            raise RuntimeError(
                "The vLLM server returned no log-prob for a sampled token (non-finite logits?)."
            )
        samples.append((choice["token_ids"], logps))
    return samples
