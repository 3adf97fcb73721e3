"""The model card (issue 44, item 6): README.md beside the saved weights on save_model, in each checkpoint
and in output_dir at checkpoints (TRL's place), and on push_to_hub (the Hub mocked), for LoRA and full
fine-tuning: TRL's front matter and tags, the base model and dataset, the GRPO settings, the framework
versions and the citations; the model tagged for the Hub as TRL tags it."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from huggingface_hub import ModelCard
from peft import LoraConfig
from tiny_models import tiny_llama, tiny_tokenizer
from trainer_helpers import chat_dataset, length_reward, make_config

from grpo_hf import GRPOTrainer
from grpo_hf.training.model_card import hub_id

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the id the tiny model's config says it was loaded from


def shorter_reward(completions, **kwargs) -> list[float]:
    return [-len(c) / 10 for c in completions]


def make_trainer(tmp_path, lora: bool, **settings) -> GRPOTrainer:
    model = tiny_llama()
    model.config._name_or_path = BASE
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    args = make_config(tmp_path, max_steps=1, num_generations=4, reward_weights=[1.0, 0.5], **settings)
    return GRPOTrainer(
        model=model,
        reward_funcs=[length_reward, shorter_reward],
        args=args,
        train_dataset=chat_dataset(),
        processing_class=tiny_tokenizer(),
        peft_config=peft_config,
    )


def read_card(folder: Path) -> ModelCard:
    return ModelCard.load(folder / "README.md")


def check_card(card: ModelCard, lora: bool, steps: int, name: str) -> None:
    """What every card says, with the numbers of make_trainer's run."""
    data = card.data
    assert data.base_model == BASE and data.model_name == name and data.pipeline_tag == "text-generation"
    assert data.library_name == ("peft" if lora else "transformers")
    assert data.tags[:4] == ["generated_from_trainer", "trl", "grpo", "grpo-hf"]  # TRL's, then ours
    assert ("lora" in data.tags and f"base_model:adapter:{BASE}" in data.tags) is lora
    text = card.text
    assert f"# Model Card for {name}" in text
    assert f"fine-tuned version of [{BASE}](https://huggingface.co/{BASE})" in text
    assert "[DeepSeekMath: Pushing the Limits" in text and "https://huggingface.co/papers/2402.03300" in text
    assert "Reward functions: `length_reward` (weight 1), `shorter_reward` (weight 0.5)." in text
    trained = "a LoRA adapter, r=4, alpha=8, dropout=0.0, on q_proj, v_proj" if lora else "all weights"
    assert f"| trained | {trained}" in text
    for row in (f"| optimizer steps | {steps} |", "| num_generations | 4 |", "| beta | 0.04 |",
                "| learning_rate | 0.01 |", "| per_device_train_batch_size | 8 |", "| precision | fp32 |",
                "| loss_type | dapo |", "| processes | 1 |", "| lr_scheduler_type | linear |"):  # fmt: skip
        assert row in text, row
    assert f"- Transformers: {transformers.__version__}" in text and "- PEFT: " in text
    assert "@article{shao2024deepseekmath" in text and "eprint       = {arXiv:2402.03300}" in text
    assert "@software{grpo_hf" in text


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_save_model_writes_the_card_beside_the_weights(tmp_path, lora):
    trainer = make_trainer(tmp_path / "run", lora)
    trainer.train()
    folder = tmp_path / "final"
    trainer.save_model(str(folder))
    assert (folder / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    check_card(read_card(folder), lora, steps=1, name="run")
    assert 'pipeline("text-generation", model="' + str(folder) + '"' in read_card(folder).text


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_each_checkpoint_and_output_dir_get_the_card(tmp_path, lora):
    trainer = make_trainer(tmp_path, lora, save_strategy="steps", save_steps=1)
    trainer.train()
    check_card(read_card(tmp_path / "checkpoint-1"), lora, steps=1, name=tmp_path.name)
    check_card(read_card(tmp_path), lora, steps=1, name=tmp_path.name)  # where TRL writes it


def test_the_model_is_tagged_for_the_hub_as_trl_tags_it(tmp_path):
    for lora in (True, False):
        trainer = make_trainer(tmp_path, lora)
        model = trainer.model.get_base_model() if lora else trainer.model
        assert model.model_tags == ["trl", "grpo", "grpo-hf"]


class FakeHub:
    """Stands in for transformers' hf_api(): records the repo made and what each upload's README said."""

    def __init__(self):
        self.repos, self.cards = [], []

    def create_repo(self, repo_name, token, private, exist_ok):
        self.repos.append(repo_name)
        return SimpleNamespace(repo_id=f"someone/{Path(repo_name).name}")

    def upload_folder(self, repo_id, folder_path, **kwargs):
        self.cards.append((repo_id, ModelCard.load(os.path.join(folder_path, "README.md"))))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_push_to_hub_uploads_the_card_with_the_dataset(tmp_path, monkeypatch, lora):
    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    trainer = make_trainer(tmp_path / "grpo-run", lora)
    trainer.train()
    trainer.push_to_hub(dataset_name="trl-lib/DeepMath-103K")
    ((repo, card),) = hub.cards
    assert repo == "someone/grpo-run"
    check_card(card, lora, steps=1, name="grpo-run")
    assert card.data.datasets == "trl-lib/DeepMath-103K"  # a string, as TRL writes it
    assert (
        "on the [trl-lib/DeepMath-103K](https://huggingface.co/datasets/trl-lib/DeepMath-103K) dataset"
        in card.text
    )
    assert 'pipeline("text-generation", model="someone/grpo-run"' in card.text
    # The dataset is remembered: a later save's card names it too.
    trainer.save_model(str(tmp_path / "again"))
    assert read_card(tmp_path / "again").data.datasets == "trl-lib/DeepMath-103K"


def test_a_local_dataset_and_model_are_named_in_the_text_only(tmp_path):
    trainer = make_trainer(tmp_path, lora=False)
    data = tmp_path / "my.jsonl"
    data.write_text("{}\n")
    trainer.model.config._name_or_path = str(tmp_path)  # a local folder, as the embedded default's cache
    trainer.create_model_card(dataset_name=str(data))
    card = read_card(tmp_path)
    assert card.data.base_model is None and card.data.datasets is None  # the Hub takes ids only
    assert f"the local model `{tmp_path}` on the local dataset `{data}`" in card.text


@pytest.mark.parametrize(
    ("name", "expected"),
    [("openai/gsm8k", "openai/gsm8k"), ("gsm8k", "gsm8k"), ("my.jsonl", None), ("", None), (None, None),
     ("./data/train.jsonl", None), ("a/b/c", None)],
)  # fmt: skip
def test_only_hub_ids_reach_the_metadata(name, expected):
    assert hub_id(name) == expected
