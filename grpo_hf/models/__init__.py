"""Models: `loading` (a causal LM and its tokenizer by hub id, folder, GGUF file or the embedded
default), `policy` (the policy a run trains, made ready: PEFT, float32 head, dropout off),
`reference` (the frozen reference and its sync) and `sharding` (FSDP / DeepSpeed placement and
gathers). `from grpo_hf.models import load_model, ...` takes the loading names from here."""

from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_path

__all__ = ["DEFAULT_MODEL", "load_model", "load_tokenizer", "resolve_model_path"]
