"""What colocate and server mode share, without importing vLLM: which requests a batch of prompt
rows becomes, their seeds and sampling parameters, and the `Rollout` of what comes back.

Rows repeat each prompt G times (a group may be split between processes). Each distinct prompt is
one request with n = its rows (`plan_prompts`), so vLLM prefills it once; sample j of prompt k goes
back to the j-th row holding that prompt. Every request has its own seed (`request_seed`: the
run's seed, the policy version, the call since the weights changed, the request's place), so a
run is reproducible and no two requests share random numbers (vLLM seeds sample j of a request
with seed + j). The training thread's calls are counted (0, 1, ...); async GRPO's generation
thread names its calls by round ('round 3.1': round 3's second call), so the two never share a key.
"""

import hashlib

import torch

from grpo_hf.data.rollout import Rollout, right_padded
from grpo_hf.engine.generation import Sampling

# One request's completions: per sample, its token ids and the sampler's log-probs of them.
Samples = list[tuple[list[int], list[float]]]


def prompt_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """(B, P) left-padded prompts as B token lists without padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]


def plan_prompts(rows: list[list[int]]) -> tuple[list[list[int]], list[int], list[tuple[int, int]]]:
    """The distinct prompts in order of first appearance, how many rows hold each (n of its request),
    and for every row (its prompt's index, its sample's index within that request)."""
    index: dict[tuple[int, ...], int] = {}
    prompts, counts, slots = [], [], []
    for row in rows:
        k = index.setdefault(tuple(row), len(prompts))
        if k == len(prompts):
            prompts.append(row)
            counts.append(0)
        slots.append((k, counts[k]))
        counts[k] += 1
    return prompts, counts, slots


def request_seed(seed: int, version: int, call: int | str, key: int | str) -> int:
    """A 48-bit seed for one request, a pure function of its four coordinates (`call`: the training
    thread's call count, or the generation thread's call name; `key`: the request's place)."""
    digest = hashlib.blake2b(f"{seed}/{version}/{call}/{key}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def sampling_fields(sampling: Sampling, n: int, seed: int, regex: str | None) -> dict:
    """vLLM SamplingParams fields (also the /v1/completions body's) for one request.

    Every knob is explicit (a server would otherwise fill unset ones from the model's
    generation_config); the EOS tokens are stop tokens (kept in the output, as our decoder keeps
    them); generation_kwargs override the rest (TRL's rule). Log-probs: the drawn token's only.
    """
    fields = dict(
        n=n,
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p or 0.0,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logprobs=0,
        seed=seed,
        stop_token_ids=list(sampling.eos_token_ids),
        skip_special_tokens=False,
    )
    if regex is not None:
        fields["structured_outputs"] = {"regex": regex}
    extra = sampling.generation_kwargs
    if "n" in extra:
        raise ValueError(
            "generation_kwargs: 'n' must not be set (each prompt is already repeated num_generations times); "
            "set num_generations instead."
        )
    return fields | extra


def samples_for_rows(per_prompt: list[Samples], slots: list[tuple[int, int]]) -> Samples:
    """Each row's sample, by its slot (`plan_prompts`)."""
    return [per_prompt[k][j] for k, j in slots]


def rollout_from_samples(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples: Samples, sampling: Sampling
) -> Rollout:
    """The `Rollout` of one sample per prompt row: completions cut after their first EOS (pad, and
    log-prob 0, after it), truncated where no EOS came."""
    device = prompt_ids.device
    ids = right_padded([tokens for tokens, _ in samples], -1, torch.long, device)  # (B, C) -1 after the end
    logps = right_padded([values for _, values in samples], 0.0, torch.float32, device)  # (B, C)
    return Rollout.from_tokens(
        prompt_ids, prompt_mask, ids, logps, sampling.eos_token_ids, sampling.pad_token_id, ended=ids >= 0
    )
