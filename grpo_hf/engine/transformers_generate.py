"""Generation through transformers' own engines, for what our decoding loop does not do.

- `with_generate`: `model.generate`, when the run asks for a KV-cache implementation
  (`cache_implementation`, e.g. "static") or for `generation_kwargs` our loop does not implement
  (beam search, stop strings, ...): TRL's own path, so those settings mean what they mean there.
- `with_continuous_batching`: `model.generate_batch` (`use_transformers_continuous_batching`).

Both return the same `Rollout` as `local.generate`: completions cut after the first EOS, and
the sampler's log-probs of the drawn tokens (under the processed distribution, as our decoder
records them) where the engine exposes them; beam search has no per-token sampling distribution,
so there `sampler_logps` is None.
"""

import torch
from torch import nn
from transformers import GenerationConfig

from grpo_hf.data.rollout import Rollout, right_padded


def _finish(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    logps: torch.Tensor | None,
    config: GenerationConfig,
) -> Rollout:
    """The Rollout of generate's rows, cut after their first EOS."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return Rollout.from_tokens(prompt_ids, prompt_mask, completion_ids, logps, eos, config.pad_token_id)


@torch.no_grad()
def with_generate(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig
) -> Rollout:
    """One completion per (B, P) left-padded prompt row through `model.generate`."""
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
    finally:
        model.train(was_training)
    completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # (B, C)
    logps = None
    if (config.num_beams or 1) == 1 and out.scores:
        scores = torch.stack(out.scores, dim=1).float()  # (B, C, V) after the logits processors
        logps = torch.log_softmax(scores, dim=-1).gather(2, completion_ids.unsqueeze(2)).squeeze(2)  # (B, C)
        logps = logps.nan_to_num(0.0, neginf=0.0)  # rows padded after their EOS score -inf on pad
    return _finish(prompt_ids, prompt_mask, completion_ids, logps, config)


@torch.no_grad()
def with_continuous_batching(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
    batching_kwargs: dict,
) -> Rollout:
    """One completion per prompt row through `model.generate_batch`, with the sampler's log-probs."""
    from transformers.generation import ContinuousBatchingConfig

    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    batching = ContinuousBatchingConfig(
        **({"max_memory_percent": 0.5} | batching_kwargs | {"return_logprobs": True})
    )
    was_training = model.training
    model.eval()
    try:
        outputs = model.generate_batch(
            prompts, generation_config=config, continuous_batching_config=batching, progress_bar=False
        )
    finally:
        model.train(was_training)
    results = list(outputs.values())
    if len(results) != len(prompts) or any(r.error is not None for r in results):
        raise RuntimeError(
            f"transformers' continuous batching returned {len(results)} of {len(prompts)} completions "
            f"({[r.error for r in results if r.error is not None][:3]}); set "
            "use_transformers_continuous_batching=False to generate with grpo-hf's decoder."
        )
    device = prompt_ids.device
    completion_ids = right_padded(
        [r.generated_tokens for r in results], config.pad_token_id, torch.long, device
    )
    logps = right_padded([r.logprobs for r in results], 0.0, torch.float32, device)  # (B, C)
    return _finish(prompt_ids, prompt_mask, completion_ids, logps, config)
