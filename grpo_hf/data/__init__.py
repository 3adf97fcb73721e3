"""What a round is made of, with no model in sight: `rollout` (the `Rollout` of a batch of prompts
and completions, prompt rendering and padding), `batches` (dataset checks, the group sampler, the
round's loss tensors and micro-batches, `ScoredRound`), `streaming` (iterable datasets in group
order), `tool_results` (the marker of a failed tool call, which episodes write and rewards read), `calls`
(calls with a time limit on threads, for episodes, training and the vLLM engine alike)."""
