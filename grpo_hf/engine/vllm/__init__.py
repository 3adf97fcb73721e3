"""vLLM as the generation engine, behind `engine.generation.Generator`.

- `colocate.ColocateGenerator`: a vLLM engine inside each training process (`external_launcher`,
  no engine subprocess), on the process's own device; new weights go in through
  `collective_rpc("reload_weights")`.
- `server.ServerGenerator`: a vLLM server started separately (`python -m
  vllm.entrypoints.openai.api_server`, with `VLLM_SERVER_DEV_MODE=1`). The prompts of every process
  are gathered, each distinct one is sent once with n = its rows, and each process gets back its
  own rows. New weights go as a safetensors file in a shared folder plus `/collective_rpc
  reload_weights` (any machine, no NCCL), or over NCCL through vLLM's weight-transfer API (CUDA).
- `requests`: what both modes share (prompt planning, request seeds, sampling parameters, the
  `Rollout` of vLLM's outputs); `weights`: the policy's weights as vLLM's loader reads them.

Completions carry the sampler's own log-probs (logprobs_mode='processed_logprobs': after
temperature and the truncations), 0 after the first EOS, in `Rollout.sampler_logps`.
"""

from collections.abc import Callable

from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_hf.engine.generation import Generator


def vllm_generator(
    args,
    accelerator: Accelerator,
    model: nn.Module,
    policy: Callable[[], nn.Module],
    tokenizer: PreTrainedTokenizerBase,
) -> Generator:
    """The generator vllm_mode asks for."""
    if args.vllm_mode == "colocate":
        from grpo_hf.engine.vllm.colocate import ColocateGenerator

        return ColocateGenerator(args, accelerator, model, policy, tokenizer)
    from grpo_hf.engine.vllm.server import ServerGenerator

    return ServerGenerator(args, accelerator, model, policy)
