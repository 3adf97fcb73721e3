"""The model card: a README.md beside every saved model, as TRL's trainers write theirs.

`GRPOTrainer` writes it where the weights go (`save_model`, each checkpoint folder), into output_dir
at each checkpoint (before the Trainer pushes that folder to the Hub, as TRL does) and on
`push_to_hub` / `create_model_card` (TRL's `model_name`, `dataset_name`, `tags`). The card has the
Hub metadata (base model and dataset where they are Hub ids, `library_name` peft for an adapter,
tags), the base model and dataset named in the text where they are local, the GRPO settings that
shape the result, the framework versions, and the GRPO (DeepSeekMath, arXiv 2402.03300) and grpo-hf
citations. Its tags are TRL's GRPO tags (`trl`, `grpo`), so the Hub lists the model with TRL's, and
`grpo-hf`; for an adapter also PEFT's (`lora`, `base_model:adapter:<id>`): this card replaces the
one PEFT writes. Departure from TRL: TRL writes the card into output_dir only; here a checkpoint or a
`save_model(other_dir)` folder gets its own, so that a folder holding weights says what they are.
The dataset's name is known only when given (`dataset_name` of `create_model_card` / `push_to_hub`, or
`trainer.model_card.dataset_name` before training): a `datasets.Dataset` does not keep the Hub id it
was loaded from.
"""

import os
import re
import textwrap
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from peft import PeftModel
from torch import nn

TAGS = ("trl", "grpo", "grpo-hf")  # TRL's GRPOTrainer tags first: the Hub groups the model with TRL's
GRPO_CITATION = textwrap.dedent("""\
    @article{shao2024deepseekmath,
        title        = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
        author       = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
        year         = 2024,
        eprint       = {arXiv:2402.03300},
    }""")
GRPO_HF_CITATION = textwrap.dedent("""\
    @software{grpo_hf,
        title        = {{grpo-hf: Group Relative Policy Optimization for the Hugging Face stack}},
        license      = {Apache-2.0},
        version      = {VERSION},
    }""")
# The settings that shape what GRPO learned, in the card's table in this order.
SETTINGS = (
    "learning_rate", "lr_scheduler_type", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_generations", "steps_per_generation", "num_iterations", "max_prompt_length", "max_completion_length",
    "temperature", "top_p", "beta", "loss_type", "scale_rewards", "epsilon", "epsilon_high",
    "importance_sampling_level", "mask_truncated_completions", "use_vllm", "seed",
)  # fmt: skip
FRAMEWORKS = (
    ("grpo-hf", "grpo-hf"), ("Transformers", "transformers"), ("Pytorch", "torch"), ("Datasets", "datasets"),
    ("Tokenizers", "tokenizers"), ("PEFT", "peft"), ("Accelerate", "accelerate"),
)  # fmt: skip
Tags = str | list[str] | None  # TRL's create_model_card `tags`
# A Hub repo id: 'owner/name', or a legacy canonical name without owner (and without a dot: not a file).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+|[\w-]+")


class ModelCardWriter:
    """Writes the model card of a `GRPOTrainer`'s policy; remembers the dataset name and tags given
    to `write`, so that later cards (checkpoints, the final save) keep them."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.dataset_name: str | None = None
        self.tags: list[str] = []
        model = trainer.model
        if hasattr(model, "add_model_tags"):  # a PreTrainedModel or a PeftModel (which passes it on)
            model.add_model_tags(list(TAGS))  # transformers' push_to_hub adds model_tags to the card's

    def write(
        self,
        folder: str,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: Tags = None,
    ) -> None:
        """Write <folder>/README.md (on the processes that save)."""
        self.dataset_name = dataset_name or self.dataset_name
        self.tags = unique([*self.tags, *([tags] if isinstance(tags, str) else tags or [])])
        trainer = self.trainer
        if not trainer.args.should_save:
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        name = model_name or model_name_of(trainer.args)
        os.makedirs(folder, exist_ok=True)
        card = model_card(model, trainer, name, trainer.hub_model_id or folder, self.dataset_name, self.tags)
        card.save(os.path.join(folder, "README.md"))


def model_name_of(args) -> str:
    """TRL's model name: the Hub repo's name when pushing to one, else output_dir's last part."""
    return args.hub_model_id.split("/")[-1] if args.hub_model_id else Path(args.output_dir).name


def model_card(
    model: nn.Module, trainer, model_name: str, repo: str, dataset_name: str | None, tags: list[str]
) -> ModelCard:
    """The card of `model`, trained by `trainer` (its args, reward functions, state)."""
    base = model.config._name_or_path  # a PeftModel passes config on to its base model's
    base_id, dataset_id = hub_id(base), hub_id(dataset_name)
    adapter = isinstance(model, PeftModel)
    peft_tags = [model.active_peft_config.peft_type.value.lower(), "transformers"] if adapter else []
    peft_tags += [f"base_model:adapter:{base_id}"] if adapter and base_id else []
    data = ModelCardData(
        base_model=base_id,
        datasets=dataset_id,
        library_name="peft" if adapter else "transformers",
        model_name=model_name,
        pipeline_tag="text-generation",
        tags=unique(["generated_from_trainer", *TAGS, *peft_tags, *tags]),
    )
    text = "\n\n".join(
        [
            f"# Model Card for {model_name}",
            origin(base, base_id, dataset_name, dataset_id),
            quick_start(repo),
            training_procedure(model, trainer),
            "### Framework versions\n\n"
            + "\n".join(f"- {name}: {installed(pkg)}" for name, pkg in FRAMEWORKS),
            citations(),
        ]
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}\n")


def origin(base: str, base_id: str | None, dataset_name: str | None, dataset_id: str | None) -> str:
    """What the model was fine-tuned from and on, linked where they are on the Hub."""
    model = f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"the local model `{base}`"
    model = model if base else "a model built from its config"
    if dataset_id:
        model += f" on the [{dataset_id}](https://huggingface.co/datasets/{dataset_id}) dataset"
    elif dataset_name:
        model += f" on the local dataset `{dataset_name}`"
    return (
        f"This model is a fine-tuned version of {model}.\nIt has been trained using grpo-hf, a GRPO trainer "
        "for the Hugging Face stack (TRL's `GRPOTrainer` API on `transformers.Trainer`)."
    )


def quick_start(repo: str) -> str:
    """TRL's quick start: the model in a text-generation pipeline, from the Hub repo or the folder."""
    return textwrap.dedent(f"""\
        ## Quick start

        ```python
        from transformers import pipeline

        question = "What is 17 + 25?"
        generator = pipeline("text-generation", model="{repo}", device_map="auto")
        output = generator([{{"role": "user", "content": question}}], max_new_tokens=128, return_full_text=False)[0]
        print(output["generated_text"])
        ```""")


def training_procedure(model: nn.Module, trainer) -> str:
    """The method, the reward functions, what was trained and the settings that shape the result."""
    args = trainer.args
    rewards = ", ".join(
        f"`{name}` (weight {weight:g})"
        for name, weight in zip(trainer.reward_func_names, trainer.reward_weights.tolist(), strict=True)
    )
    rows = [
        ("trained", adapter_line(model)),
        ("optimizer steps", trainer.state.global_step),
        ("processes", args.world_size),
        ("precision", "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"),
        *((name, plain(getattr(args, name))) for name in SETTINGS),
    ]
    table = "\n".join(["| setting | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])
    url = wandb_url(args.report_to)
    badge = f"[Visualize in Weights & Biases]({url})\n\n" if url else ""
    return (
        f"## Training procedure\n\n{badge}This model was trained with GRPO, a method introduced in "
        "[DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models]"
        f"(https://huggingface.co/papers/2402.03300).\n\nReward functions: {rewards}.\n\n"
        f"### GRPO settings\n\n{table}"
    )


def adapter_line(model: nn.Module) -> str:
    """'LoRA r=16, alpha=32 on q_proj, v_proj' for an adapter; 'all weights' for full fine-tuning."""
    if not isinstance(model, PeftModel):
        return "all weights (full fine-tuning)"
    config = model.active_peft_config
    targets = config.target_modules  # names, or one regular expression
    on = targets if isinstance(targets, str) else ", ".join(sorted(targets or []))
    if config.peft_type.value != "LORA":
        return f"a {config.peft_type.value} adapter on {on}"
    return f"a LoRA adapter, r={config.r}, alpha={config.lora_alpha}, dropout={config.lora_dropout}, on {on}"


def citations() -> str:
    """The GRPO and grpo-hf citations, as BibTeX."""
    ours = GRPO_HF_CITATION.replace("VERSION", installed("grpo-hf"))
    return f"## Citations\n\nCite GRPO as:\n\n```bibtex\n{GRPO_CITATION}\n```\n\nCite grpo-hf as:\n\n```bibtex\n{ours}\n```"


def hub_id(name: str | None) -> str | None:
    """`name` if it reads as a Hub repo id and is no local path, else None (the card's metadata takes
    Hub ids only: the Hub refuses a base_model that is not one)."""
    if not name or os.path.exists(name) or not HUB_ID.fullmatch(name):
        return None
    return name


def installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def wandb_url(report_to: list[str]) -> str | None:
    """The wandb run's page, where this run reports to wandb online."""
    if "wandb" not in report_to:
        return None
    import wandb

    run = wandb.run
    return run.url if run is not None and not (run.offline or run.disabled) else None


def plain(value: object) -> object:
    """A setting as the config file writes it: an enum (lr_scheduler_type) by its value."""
    return value.value if isinstance(value, Enum) else value


def unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
