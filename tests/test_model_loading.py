"""Loading the policy, the reference and reward models by name: model_init_kwargs (dtype among
them), trust_remote_code, quantization_config."""

import importlib.util
import json
import logging
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import LLAMA_LIKE, tiny_llama, tiny_tokenizer
from trainer_helpers import FixedCompletionsTrainer, chat_dataset, length_reward, make_config
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForSequenceClassification
from transformers.utils import HF_MODULES_CACHE

from grpo_hf import GRPOTrainer
from grpo_hf.models.policy import model_init_kwargs, reference_init_kwargs, tokenizer_init_kwargs
from grpo_hf.rewards.scoring import RewardModel


def saved_model(folder: Path, dtype: torch.dtype = torch.float32) -> str:
    tiny_llama().to(dtype).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def trainer_for(tmp_path, model, **overrides) -> FixedCompletionsTrainer:
    return FixedCompletionsTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_config(tmp_path / "out", max_steps=1, **overrides),
        train_dataset=chat_dataset(),
    )


# ---- model_init_kwargs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("init_kwargs", "dtype"),
    [(None, torch.float32), ({"dtype": "bfloat16"}, torch.bfloat16), ({"dtype": "auto"}, torch.bfloat16)],
    ids=["default-float32", "bfloat16", "auto-keeps-the-checkpoints"],
)
def test_model_init_kwargs_dtype(tmp_path, init_kwargs, dtype):
    path = saved_model(tmp_path / "bf16", torch.bfloat16)  # a bfloat16 checkpoint
    trainer = trainer_for(tmp_path, path, model_init_kwargs=init_kwargs)
    assert trainer.model.dtype == dtype
    trainer.train()
    assert trainer.state.global_step == 1


def test_model_init_kwargs_reach_from_pretrained_and_the_reference(tmp_path):
    path = saved_model(tmp_path / "m")
    trainer = trainer_for(
        tmp_path, path, model_init_kwargs={"attn_implementation": "eager"}, beta=0.1
    )  # beta > 0: a reference, loaded by name below
    assert trainer.model.config._attn_implementation == "eager"
    with_ref = GRPOTrainer(
        model=path,
        reward_funcs=length_reward,
        args=make_config(tmp_path / "r", max_steps=1, model_init_kwargs={"dtype": "bfloat16"}),
        train_dataset=chat_dataset(),
        ref_model=path,
    )
    assert with_ref.ref_model.dtype == torch.bfloat16  # the reference loaded as the policy was
    with_ref.train()


def test_reference_takes_the_policys_dtype_and_attention_unless_named():
    policy = tiny_llama().to(torch.bfloat16)
    policy.config._attn_implementation = "eager"
    args = SimpleNamespace(model_init_kwargs=None)
    kwargs = reference_init_kwargs(args, {"dtype": torch.float32, "trust_remote_code": False}, policy)
    assert kwargs == {"dtype": torch.bfloat16, "trust_remote_code": False, "attn_implementation": "eager"}
    args = SimpleNamespace(model_init_kwargs={"dtype": "float16"})
    assert reference_init_kwargs(args, {"dtype": torch.float16}, policy)["dtype"] == torch.float16


def test_model_init_kwargs_in_a_multi_process_run_leave_placement_to_accelerate():
    args = SimpleNamespace(
        model_init_kwargs={"device_map": "auto", "revision": "v1"}, trust_remote_code=True, world_size=2
    )
    assert model_init_kwargs(args) == {
        "device_map": None, "revision": "v1", "trust_remote_code": True, "dtype": torch.float32
    }  # fmt: skip
    assert tokenizer_init_kwargs(args) == {"trust_remote_code": True, "revision": "v1"}


def test_a_bad_dtype_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="model_init_kwargs dtype='float8'"):
        trainer_for(tmp_path, "/no/such/model", model_init_kwargs={"dtype": "float8"})


def test_model_init_kwargs_of_a_model_object_are_ignored_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = FixedCompletionsTrainer(
            model=tiny_llama(),
            reward_funcs=length_reward,
            args=make_config(tmp_path, model_init_kwargs={"dtype": "bfloat16"}),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
        )
    assert trainer.model.dtype == torch.float32
    assert "model_init_kwargs and quantization_config, which apply to a model given by name" in caplog.text


# ---- quantization_config ------------------------------------------------------------------------


def test_quantization_config_goes_to_from_pretrained(tmp_path, monkeypatch):
    received = {}

    def from_pretrained(path, **kwargs):
        received.update(kwargs)
        return tiny_llama()

    monkeypatch.setattr("grpo_hf.models.loading.AutoModelForCausalLM.from_pretrained", from_pretrained)
    quantization = SimpleNamespace(quant_method="some_method")  # any config: handed on as it is
    trainer = GRPOTrainer(
        model=saved_model(tmp_path / "m"),
        reward_funcs=length_reward,
        args=make_config(tmp_path / "out", max_steps=1, beta=0.0),
        train_dataset=chat_dataset(),
        quantization_config=quantization,
    )
    assert received == {
        "quantization_config": quantization,
        "trust_remote_code": False,
        "dtype": torch.float32,
    }
    trainer.train()
    assert trainer.state.global_step == 1


def test_quantization_config_given_twice_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="quantization_config is set both"):
        GRPOTrainer(
            model="/no/such/model",
            reward_funcs=length_reward,
            args=make_config(tmp_path, model_init_kwargs={"quantization_config": {"load_in_4bit": True}}),
            train_dataset=chat_dataset(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_bitsandbytes_missing_is_named_before_the_model_loads(tmp_path):
    with pytest.raises(
        ImportError, match="quantization_config is a BitsAndBytesConfig.*pip install bitsandbytes"
    ):
        GRPOTrainer(
            model="/no/such/model",
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=chat_dataset(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )


# ---- trust_remote_code --------------------------------------------------------------------------

CONFIGURATION = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote_llama"
"""
MODELING = """import torch
from torch import nn
from transformers import LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaPreTrainedModel):
    config_class = RemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(self, input_ids, attention_mask, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1  # right padding: each row's last real token
        return SequenceClassifierOutput(logits=self.score(hidden)[torch.arange(len(last)), last])
"""


def remote_code_model(folder: Path, head: str = "causal") -> str:
    """A checkpoint whose classes live in its own Python files (as models with custom code ship).

    transformers copies such files into a module cache named after the folder: a fresh name per
    call keeps another run's copy from standing in for these files.
    """
    folder = folder.with_name(f"{folder.name}_{uuid.uuid4().hex[:8]}")
    folder.mkdir()
    (folder / "configuration_remote.py").write_text(CONFIGURATION)
    (folder / "modeling_remote.py").write_text(MODELING)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, eos_token_id=2, bos_token_id=1, num_labels=1, **LLAMA_LIKE)
    model = tiny_llama() if head == "causal" else LlamaForSequenceClassification(config)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    settings = json.loads((folder / "config.json").read_text())
    settings |= {
        "model_type": "remote_llama",
        "architectures": ["RemoteForCausalLM" if head == "causal" else "RemoteForSequenceClassification"],
        "auto_map": {
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
            "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
        },
    }
    (folder / "config.json").write_text(json.dumps(settings))
    return str(folder)


@pytest.fixture
def remote_code(tmp_path):
    """`make(name, head)` -> a custom-code checkpoint; transformers' copies of its files are removed after."""
    made = []

    def make(name: str, head: str = "causal") -> str:
        path = remote_code_model(tmp_path / name, head)
        made.append(Path(path).name)
        return path

    yield make
    for name in made:
        shutil.rmtree(Path(HF_MODULES_CACHE) / "transformers_modules" / name, ignore_errors=True)


def test_trust_remote_code_lets_the_policys_own_code_run(tmp_path, remote_code):
    path = remote_code("remote_policy")
    with pytest.raises(ValueError, match="trust_remote_code"):
        trainer_for(tmp_path, path)
    trainer = trainer_for(tmp_path, path, trust_remote_code=True)
    assert type(trainer.model).__name__ == "RemoteForCausalLM"
    trainer.train()
    assert trainer.state.global_step == 1


def test_trust_remote_code_reaches_reward_models(tmp_path, remote_code):
    path = remote_code("remote_reward", head="classifier")
    args = make_config(tmp_path / "out", max_steps=1, trust_remote_code=True)
    trainer = FixedCompletionsTrainer(
        model=tiny_llama(),
        reward_funcs=[length_reward, path],
        args=args,
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
    )
    reward = trainer.reward_funcs[1]
    assert (
        isinstance(reward, RewardModel) and type(reward.model).__name__ == "RemoteForSequenceClassification"
    )
    trainer.train()
    assert any(key.startswith("reward/remote_reward_") for key in trainer.state.log_history[0])
