"""Tiny Llama / GPT-2 models and a byte-level tokenizer, built offline from configs; a scripted
decoder that stands in for a model in the decode loop."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 bytes + 3 specials) with a ChatML template; eos = <|im_end|>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# Sizes shared by the tiny Llama-like models: 2 layers, 4 query heads over 2 key/value heads.
LLAMA_LIKE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
}


def tiny_llama(seed: int = 0, vocab_size: int = 259) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, eos_token_id=2, bos_token_id=1, **LLAMA_LIKE)
    return LlamaForCausalLM(config)


def tiny_gpt2(seed: int = 0, vocab_size: int = 259) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=512,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    return GPT2LMHeadModel(config)


def tiny_mistral() -> MistralForCausalLM:
    """A Llama-like model with a sliding window (4096 by default): not packable."""
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=259, **LLAMA_LIKE))


# Each family the README names, as transformers builds it (its own attention, soft-capping, sliding
# windows, experts), at the tiny Llama's sizes; head_dim 8 where a config would derive another.
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=259, **LLAMA_LIKE)),
    "gpt2": lambda: tiny_gpt2(),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=259, **LLAMA_LIKE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(vocab_size=259, head_dim=8, **LLAMA_LIKE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(vocab_size=259, sliding_window=4, **LLAMA_LIKE)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(vocab_size=259, **LLAMA_LIKE)),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(vocab_size=259, head_dim=8, **LLAMA_LIKE)),
    "gemma2": lambda: Gemma2ForCausalLM(
        Gemma2Config(vocab_size=259, head_dim=8, sliding_window=4, **LLAMA_LIKE)
    ),
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(vocab_size=259, head_dim=8, sliding_window=4, **LLAMA_LIKE)
    ),
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(vocab_size=259, num_local_experts=4, num_experts_per_tok=2, **LLAMA_LIKE)
    ),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=259,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            **LLAMA_LIKE,
        )
    ),
}


def tiny_family(name: str, seed: int = 0) -> PreTrainedModel:
    """A tiny model of family `name` (`FAMILIES`), eos 2 and bos 1 as the tiny tokenizer's."""
    torch.manual_seed(seed)
    model = FAMILIES[name]()
    model.config.eos_token_id, model.config.bos_token_id = 2, 1
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = 2, 1
    return model


class ScriptedDecoder:
    """Row r of the batch draws token 3 until its step `lengths[r] - 1`, then EOS (2), greedily.

    It knows which batch rows it is serving only through `keep`, so rows mixed up there would
    draw the wrong tokens; `rows_per_call` records the rows of every call.
    """

    def __init__(self, lengths: list[int]):
        self.lengths, self.serving, self.step, self.rows_per_call = torch.tensor(lengths), None, 0, []

    def logits(self) -> torch.Tensor:
        ends = self.lengths[self.serving] - 1 == self.step  # (R,)
        self.rows_per_call.append(len(self.serving))
        return 100.0 * torch.nn.functional.one_hot(torch.where(ends, 2, 3), 5).float()  # (R, 5)

    def prefill(self, prompt_ids, prompt_mask):
        self.serving = torch.arange(prompt_ids.shape[0])
        return self.logits()

    def __call__(self, token):
        assert (token == 3).all()  # only rows still going are fed
        self.step += 1
        return self.logits()

    def keep(self, rows):
        self.serving = self.serving[rows]


def always_calling_llama(call: str) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A tiny Llama and its tokenizer that answer every turn with the text `call` (one added token),
    then EOS: greedily, and by a logit margin of about 110 at any usual sampling temperature too. A
    scripted tool call for end-to-end runs: its layers add nothing (o_proj and down_proj are zero),
    so the next token depends on the current one alone, EOS after `call`, `call` after any other."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([call])
    call_id = tokenizer.convert_tokens_to_ids(call)
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight  # (V, H) each
        embed.zero_()
        embed[:, 0] = 1.0  # every token but the call points along dimension 0, the call along 1
        embed[call_id] = torch.nn.functional.one_hot(torch.tensor(1), embed.shape[1]).float()
        head.zero_()
        head[call_id, 0] = 20.0  # after RMSNorm a one-hot hidden state is sqrt(32) ~ 5.7 long
        head[tokenizer.eos_token_id, 1] = 20.0
    return model, tokenizer
