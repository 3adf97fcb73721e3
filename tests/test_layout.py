"""The import paths the docs and recipes document keep working after the package moved into
folders: every name of `grpo_hf.__all__`, and the modules people import by name."""

import ast
import importlib
from pathlib import Path

import pytest

import grpo_hf

DOCUMENTED = {
    "grpo_hf.rewards": ["accuracy_reward", "evaluate_expression", "tool_use_reward"],
    "grpo_hf.tasks": ["arithmetic_dataset", "calculator_dataset"],
    "grpo_hf.models": ["load_model", "load_tokenizer", "resolve_model_path", "DEFAULT_MODEL"],
    "grpo_hf.evaluation": ["greedy_accuracy"],
    "grpo_hf.plotting": ["plot_training"],
    "grpo_hf.sharding": ["unsharded_for_generation"],
    "grpo_hf.script_args": ["TrlParser", "ScriptArguments"],
    "grpo_hf.script_utils": ["get_dataset", "get_peft_config"],
    "grpo_hf.config": ["GRPOConfig"],
    "grpo_hf.loss": ["grpo_loss", "kl_estimate", "LossSettings"],
    "grpo_hf.advantages": ["group_advantages", "compute_advantages"],
}


def test_every_public_name_imports():
    assert {"GRPOTrainer", "GRPOConfig", "AsyncGRPOTrainer", "AsyncGRPOConfig"} <= set(grpo_hf.__all__)
    for name in grpo_hf.__all__:
        assert getattr(grpo_hf, name) is not None


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_documented_modules_keep_their_names(module):
    imported = importlib.import_module(module)
    missing = [name for name in DOCUMENTED[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def test_the_old_paths_are_the_new_modules_own_functions():
    from grpo_hf import advantages as old_advantages
    from grpo_hf import loss as old_loss
    from grpo_hf import sharding as old_sharding
    from grpo_hf.algorithm import advantages, loss
    from grpo_hf.models import sharding

    assert old_loss.grpo_loss is loss.grpo_loss
    assert old_advantages.group_advantages is advantages.group_advantages
    assert old_sharding.unsharded_for_generation is sharding.unsharded_for_generation


def imported_modules(path: Path) -> set[str]:
    """The grpo_hf modules a source file imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("grpo_hf.")}


def test_rewards_import_no_episode_engine_or_trainer():
    """Rewards are plain functions the episodes call: the arrow goes one way (DESIGN's rooms)."""
    rewards = Path(grpo_hf.__file__).parent / "rewards"
    upward = ("grpo_hf.episodes", "grpo_hf.engine", "grpo_hf.trainer")
    found = {
        (path.name, name)
        for path in rewards.glob("*.py")
        for name in imported_modules(path)
        if name.startswith(upward)
    }
    assert not found
