"""The engine: everything that makes a rollout or a log-prob pass fast, apart from the algorithm.

The trainer asks for "completions of these prompts" (`rollout` -> `decoding.decoder_for`, the one
place a decoder is chosen) and "log-probs of these tokens" (`logprobs.completion_logps`); it never
knows which path answered. Modules:

- `decoding`: prompt prefill and decoding steps; `decoder_for` picks `LlamaDecoder` (Llama's maths
  on the raw weights) or `TransformersDecoder` (the model's own forward, any architecture);
- `cpu`: what this CPU computes natively, and oneDNN's blocked-weight matmul with its fallback;
- `generation_copy`: the low-precision, LoRA-merged copy generation samples from;
- `logprobs`, `packing`, `attention`, `token_scores`: the padding-free loss passes and the chunked
  log-softmax.
"""
