"""The policy a run trains, made from what the user gave: the `from_pretrained` keyword arguments
for a model given by name (`model_init_kwargs`, as TRL: float32 unless `model_init_kwargs` names a
dtype, so the optimizer keeps float32 master weights), the loaded policy and its tokenizer, and the
policy made ready to train (dropout off, PEFT adapters, a float32 LM head). Also what the rest of the
package asks of a PEFT model: whether it is one, and the base model under it."""

import importlib.util
import logging

import torch
from peft import PeftConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_hf.models.loading import load_model, load_tokenizer

logger = logging.getLogger(__name__)


TORCH_DTYPES = ("bfloat16", "float16", "float32")


def model_init_kwargs(
    args, quantization_config=None, default_dtype: torch.dtype | str = torch.float32
) -> dict:
    """`from_pretrained` keyword arguments for a model the trainer loads by name (see the module).

    Checked before any model work: a `dtype` that is no dtype, a `quantization_config` given twice
    or whose library is missing. In a multi-process run `device_map` is None: each process holds
    its own copy, which Accelerate places.
    """
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError(
                "quantization_config is set both as a GRPOTrainer argument and in model_init_kwargs; set it once."
            )
        kwargs["quantization_config"] = quantization_config
    if "quantization_config" in kwargs:
        check_quantization_config(kwargs["quantization_config"])
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    dtype = kwargs.get("dtype", default_dtype)
    if isinstance(dtype, str) and dtype in TORCH_DTYPES:
        dtype = getattr(torch, dtype)
    if not (isinstance(dtype, torch.dtype) or dtype in ("auto", None)):
        raise ValueError(
            f"model_init_kwargs dtype={dtype!r} is not a dtype: use one of {TORCH_DTYPES}, 'auto' (the "
            "checkpoint's) or a torch.dtype."
        )
    kwargs["dtype"] = dtype
    if args.world_size > 1:
        kwargs["device_map"] = None
    return kwargs


def reference_init_kwargs(args, init_kwargs: dict, policy: nn.Module) -> dict:
    """For a reference loaded by name: the policy's `init_kwargs`, with the policy's dtype and
    attention implementation unless model_init_kwargs names them (the policy may have been given
    as an object, or its dtype changed since loading)."""
    named = args.model_init_kwargs or {}
    kwargs = dict(init_kwargs)
    if "dtype" not in named:
        kwargs["dtype"] = next(policy.parameters()).dtype
    kwargs.setdefault("attn_implementation", policy.config._attn_implementation)
    return kwargs


def tokenizer_init_kwargs(args) -> dict:
    """`AutoTokenizer.from_pretrained` keyword arguments: `trust_remote_code`, and the model's `revision`."""
    revision = (args.model_init_kwargs or {}).get("revision")
    return {"trust_remote_code": args.trust_remote_code} | ({"revision": revision} if revision else {})


def reward_model_loading(args) -> dict:
    """`scoring.load_reward_model`'s keyword arguments for a reward model given by name: as TRL,
    `model_init_kwargs` with `trust_remote_code`, the checkpoint's dtype unless they name one, and
    the chat template's `chat_template_kwargs`."""
    return {
        "model_kwargs": model_init_kwargs(args, default_dtype="auto"),
        "tokenizer_kwargs": tokenizer_init_kwargs(args),
        "chat_template_kwargs": args.chat_template_kwargs,
    }


def check_quantization_config(config) -> None:
    """Fail before loading when a bitsandbytes `quantization_config` cannot be used here."""
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    if method == "bitsandbytes" and importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            "quantization_config is a BitsAndBytesConfig, but the bitsandbytes package is not installed: "
            "`pip install bitsandbytes` (4-bit / 8-bit loading needs a GPU it supports), or drop quantization_config "
            "(a script's --load_in_4bit / --load_in_8bit)."
        )


def load_policy(
    model: str | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    args,
    init_kwargs: dict | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy and its tokenizer: loaded by name with `init_kwargs` (`model_init_kwargs`), or a
    model given as an object, whose `model_init_kwargs` / `quantization_config` are then ignored.
    The tokenizer must have a pad token."""
    if isinstance(model, str):
        tokenizer = tokenizer or load_tokenizer(model, **tokenizer_init_kwargs(args))
        model = load_model(model, **init_kwargs)
    else:
        if args.model_init_kwargs or "quantization_config" in (init_kwargs or {}):
            logger.warning(
                "The model was passed as an object: model_init_kwargs and quantization_config, which apply to a "
                "model given by name, are not used here."
            )
        tokenizer = tokenizer or load_tokenizer(model.name_or_path, **tokenizer_init_kwargs(args))
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "The tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos_token) and pass it "
            "as processing_class."
        )
    return model, tokenizer


def prepare_policy(model: PreTrainedModel, args, peft_config: PeftConfig | None) -> nn.Module:
    """The policy made ready to train as a `GRPOConfig` asks: dropout off, the PEFT adapters of
    `peft_config`, a float32 LM head."""
    if args.disable_dropout:
        disable_dropout(model)
    if peft_config is not None:
        model = wrap_with_peft(model, peft_config, args.gradient_checkpointing)
    if args.sync_ref_model and peft_config is not None:
        raise ValueError("sync_ref_model needs a copied reference; with peft_config the base model is it.")
    if args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model)
    return model


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: old, current and reference log-probs must agree."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Turn the model's LM head into a `Float32Head` in place (`cast_lm_head_to_fp32`): its product in
    float32 whatever the model's dtype or autocast, its own weight cast to float32.

    A head tied to the input embedding (tie_word_embeddings: SmolLM2, Gemma) keeps the one weight
    they share in its dtype, so the embedding and the layers it feeds keep theirs (TRL casts it, the
    embedding with it, and casts the embedding's output back). It is float32 for a policy loaded in
    float32 (the default); otherwise the float32 product is taken on its exact upcast. A PEFT
    adapter on the head would compute outside it.
    """
    base = base_model(model)
    head = base.get_output_embeddings()
    name = type(base).__name__
    if isinstance(head, BaseTunerLayer):
        raise ValueError(
            "cast_lm_head_to_fp32=True does not support a PEFT adapter on the LM head: remove lm_head from "
            "peft_config.target_modules, or set cast_lm_head_to_fp32=False."
        )
    if type(head) is not nn.Linear:
        raise ValueError(
            f"cast_lm_head_to_fp32=True needs an nn.Linear LM head; {name}'s is a {type(head).__name__}. "
            "Set cast_lm_head_to_fp32=False."
        )
    tied = getattr(base.config.get_text_config(), "tie_word_embeddings", False)
    if not tied and head.weight is not base.get_input_embeddings().weight:
        head.to(torch.float32)
    head.__class__ = Float32Head  # same parameters and state-dict keys, float32 forward


def wrap_with_peft(
    model: PreTrainedModel, peft_config: PeftConfig, gradient_checkpointing: bool
) -> nn.Module:
    """LoRA (or another PEFT method) around the model, with a clear error for unknown target modules."""
    if gradient_checkpointing:
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, peft_config)
    except ValueError as err:
        if "not found" not in str(err) and "Target modules" not in str(err):
            raise
        names = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name})
        raise ValueError(
            f"peft_config.target_modules={peft_config.target_modules} matches no module of this model; "
            f"module names include {names[:40]}."
        ) from err


class Float32Head(nn.Linear):
    """An LM head that computes in float32 whatever the model's dtype or autocast (ScaleRL, arXiv
    2510.13786; `GRPOConfig.cast_lm_head_to_fp32`, `models.cast_lm_head_to_fp32`): float32 weights,
    and the product taken with autocast off on the hidden states cast to float32. The padding-free
    pass's fused head takes its products in float32 for it too (`_ScoringHead`)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(hidden.float(), self.weight.float(), bias)


def is_peft_model(model: nn.Module) -> bool:
    """True for a model wrapped by PEFT (LoRA and friends)."""
    return isinstance(model, PeftModel)


def base_model(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper (its adapters still in place), or `model` itself."""
    return model.get_base_model() if is_peft_model(model) else model
