"""Smoke test of recipes/grpo.py: the real script, in a subprocess, on the real default model, tiny settings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import always_calling_llama, tiny_llama, tiny_tokenizer
from trainer_helpers import free_port
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def run_recipe(
    output_dir: Path,
    *flags: str,
    launcher: tuple[str, ...] = (),
    config: str = "smollm2_lora_arithmetic.yaml",
) -> subprocess.CompletedProcess:
    command = [
        sys.executable, *launcher, str(ROOT / "recipes" / "grpo.py"),
        "--config", str(ROOT / "recipes" / "configs" / config),
        "--output_dir", str(output_dir), "--report_to", "none", "--max_steps", "2", "--save_steps", "1",
        "--num_train", "16", "--num_test", "4", "--per_device_train_batch_size", "4", "--num_generations", "2",
        "--max_completion_length", "4", "--eval_max_new_tokens", "4", "--log_completions", "false",
        *flags,
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_recipe_trains_evaluates_plots_and_saves(tmp_path):
    done = run_recipe(tmp_path, "--merge_adapter", "true")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 2
    assert 0.0 <= results["accuracy_before"] <= 1.0 and 0.0 <= results["accuracy_after"] <= 1.0
    assert len(results["samples_before"]) == 4 and len(results["samples_after"]) == 4
    assert "before:" in done.stdout and "after:" in done.stdout
    assert (tmp_path / "training.png").stat().st_size > 10_000  # a real figure, not an empty file
    # The LoRA adapter in PEFT format, a resumable checkpoint, and the merged model.
    assert (tmp_path / "adapter_config.json").is_file()
    assert (tmp_path / "adapter_model.safetensors").is_file()
    assert (tmp_path / "checkpoint-2" / "grpo_state.json").is_file()
    card = (tmp_path / "README.md").read_text()  # the model card beside the adapter
    assert "library_name: peft" in card and "- grpo-hf" in card and "| optimizer steps | 2 |" in card
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.config.model_type == "llama"
    assert not any("lora" in name for name, _ in merged.named_parameters())


@pytest.mark.slow
def test_recipe_runs_the_tool_task_in_episodes(tmp_path):
    """The calculator task end to end, on a tiny model scripted to call the tool each turn (the
    default model, untrained, almost never calls it): every episode's call is answered, in the
    evaluations before and after training and in the training round."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 56"}}</tool_call>'
    model, tokenizer = always_calling_llama(call)
    model.save_pretrained(tmp_path / "caller")
    tokenizer.save_pretrained(tmp_path / "caller")
    done = run_recipe(
        tmp_path / "out", "--model_name_or_path", str(tmp_path / "caller"), "--max_steps", "1",
        "--max_completion_length", "48", "--eval_max_new_tokens", "48",
        config="smollm2_lora_calculator.yaml",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["task"] == "calculator" and results["steps"] == 1
    # One call answered per episode: max_tool_calling_iterations=1 leaves the second turn's unanswered.
    assert results["tool_calls_before"] == 1.0 and results["tool_calls_after"] == 1.0
    assert "69104" in results["samples_before"][0][1]  # the calculator's result, in the episode
    assert "tool calls per episode: before 1.00   after 1.00" in done.stdout
    state = json.loads((tmp_path / "out" / "checkpoint-1" / "trainer_state.json").read_text())
    logged = state["log_history"][0]
    assert logged["tools/calls_per_episode"] == 1.0 and logged["tools/failure_frequency"] == 0.0


@pytest.mark.slow
def test_recipe_rejects_an_unknown_task_before_loading_the_model(tmp_path):
    done = run_recipe(tmp_path, "--task", "chess")
    assert done.returncode != 0
    assert "task='chess' is not one of ['arithmetic', 'calculator', 'countdown']" in done.stderr
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_recipe_resumes_with_resume_from_checkpoint_true(tmp_path):
    """The documented resume command (docs/troubleshooting.md): the second run takes checkpoint-1 and trains step 2 only."""
    model_dir = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    model = ("--model_name_or_path", str(model_dir), "--precision", "fp32")
    first = run_recipe(tmp_path / "out", *model, "--max_steps", "1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-1" / "grpo_state.json").is_file()
    resumed = run_recipe(
        tmp_path / "out", *model, "--resume_from_checkpoint", "true", "--log_level", "info"
    )  # max_steps 2
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Resuming training from checkpoint with epoch 0 and global step 1" in resumed.stderr
    assert json.loads((tmp_path / "out" / "results.json").read_text())["steps"] == 2
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]


@pytest.mark.slow
def test_recipe_full_finetuning_on_two_zero3_processes(tmp_path):
    """Sharded policy and reference, generation and the after-training evaluation on the main
    process alone: the whole recipe finishes under DeepSpeed ZeRO-3 (a tiny model, 2 CPU processes)."""
    model_dir = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    launcher = (
        "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes" / "accelerate" / "cpu_zero3.yaml"),
        "--main_process_port", str(free_port()), "--num_cpu_threads_per_process", "1",
    )  # fmt: skip
    done = run_recipe(
        tmp_path / "out", "--model_name_or_path", str(model_dir), "--use_peft", "false", "--precision", "fp32",
        "--per_device_train_batch_size", "2", launcher=launcher,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["steps"] == 2
    assert (tmp_path / "out" / "model.safetensors").is_file()  # gathered from both processes
