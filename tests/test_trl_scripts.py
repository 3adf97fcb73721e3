"""TRL 1.16 scripts run on grpo-hf with only their import lines changed (`trl` -> `grpo_hf`).

Each script in tests/trl_scripts/ is written against TRL's API as TRL documents it (the quick start,
GRPOConfig's settings from the command line and in code, the reward-function forms of TRL's guide,
tools and an environment that owns a reward). Here the import lines are rewritten and nothing else,
and the script runs in a subprocess on a tiny Llama saved to a folder (TRL loads such a folder the
same way; there is no model hub on these machines).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_llama, tiny_tokenizer

SCRIPTS = Path(__file__).parent / "trl_scripts"
IMPORTS = {
    "from trl import ": "from grpo_hf import ",
    "from trl.rewards import ": "from grpo_hf.rewards import ",
}


# ChatML with tools in the Hermes format (as Qwen2.5's template writes them): TRL 1.16 accepts only a
# template that renders tool calls and tool results, so the tiny model gets one for these scripts.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n{% endif %}'
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# How a reply in that template is read back (transformers' `parse_response`): Hermes calls, then text.
HERMES_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


# What TRL 1.16.0 logged at the first step of each script, run unchanged with TRL (transformers 5.23,
# this tiny model, on the CPU; the quick start is not among them: TRL's default bf16 stops it on a
# machine without a GPU). Every one of these must be in our log too, under the same name.
TRL_LOGGED_CUSTOM = [
    "accuracy",
    "clip_ratio/high_max",
    "clip_ratio/high_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/region_mean",
    "completions/clipped_ratio",
    "completions/max_length",
    "completions/max_terminated_length",
    "completions/mean_length",
    "completions/mean_terminated_length",
    "completions/min_length",
    "completions/min_terminated_length",
    "entropy",
    "frac_reward_zero_std",
    "grad_norm",
    "kl",
    "learning_rate",
    "loss",
    "num_tokens",
    "reward",
    "reward_std",
    "rewards/async_reward/mean",
    "rewards/async_reward/std",
    "rewards/boxed_reward/mean",
    "rewards/boxed_reward/std",
    "rewards/char_count_reward/mean",
    "rewards/char_count_reward/std",
    "rewards/curriculum_reward/mean",
    "rewards/curriculum_reward/std",
    "rewards/format_reward/mean",
    "rewards/format_reward/std",
    "rewards/math_only_reward/mean",
    "rewards/math_only_reward/std",
    "rewards/token_count_reward/mean",
    "rewards/token_count_reward/std",
    "step_time",
]
TRL_LOGGED_AGENT = [
    "clip_ratio/high_max",
    "clip_ratio/high_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/region_mean",
    "completions/clipped_ratio",
    "completions/max_length",
    "completions/max_terminated_length",
    "completions/mean_length",
    "completions/mean_terminated_length",
    "completions/min_length",
    "completions/min_terminated_length",
    "entropy",
    "frac_reward_zero_std",
    "grad_norm",
    "learning_rate",
    "loss",
    "num_tokens",
    "reward",
    "reward_std",
    "rewards/Counter/mean",
    "rewards/Counter/std",
    "rewards/used_a_tool/mean",
    "rewards/used_a_tool/std",
    "step_time",
    "tools/call_frequency",
    "tools/failure_frequency",
]
TRL_LOGGED_CLI = [
    "cispo_clip_ratio",
    "completions/clipped_ratio",
    "completions/max_length",
    "completions/max_terminated_length",
    "completions/mean_length",
    "completions/mean_terminated_length",
    "completions/min_length",
    "completions/min_terminated_length",
    "entropy",
    "frac_reward_zero_std",
    "grad_norm",
    "kl",
    "learning_rate",
    "loss",
    "num_tokens",
    "reward",
    "reward_std",
    "rewards/reward_len/mean",
    "rewards/reward_len/std",
    "step_time",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template, tokenizer.response_template = HERMES_TEMPLATE, HERMES_RESPONSE
    tokenizer.save_pretrained(folder)
    return folder


def ported(name: str, out: Path) -> Path:
    """The script with its TRL import lines pointed at grpo_hf; fails if any other line mentions trl."""
    lines = (SCRIPTS / name).read_text().splitlines(keepends=True)
    changed = 0
    for i, line in enumerate(lines):
        for trl, ours in IMPORTS.items():
            if line.startswith(trl):
                lines[i], changed = line.replace(trl, ours, 1), changed + 1
    assert changed >= 1
    assert not [line for line in lines if line.startswith(("import trl", "from trl"))]
    path = out / name
    path.write_text("".join(lines))
    return path


def run(script: Path, model_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MODEL": str(model_dir), "OUTPUT_DIR": str(cwd / "out"), "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def logged(done: subprocess.CompletedProcess) -> list[dict]:
    """The trainer's log history, which the script prints as its last line."""
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_trl_quick_start_runs_with_defaults(model_dir, tmp_path):
    done = run(ported("quickstart.py", tmp_path), model_dir, tmp_path)
    assert "train_runtime" in done.stdout + done.stderr
    # TRL's default output_dir when no args are given: '<model folder name>-GRPO'.
    assert (tmp_path / f"{model_dir.name}-GRPO").is_dir()


@pytest.mark.slow
def test_trl_settings_and_reward_functions(model_dir, tmp_path):
    history = logged(run(ported("custom_rewards.py", tmp_path), model_dir, tmp_path))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_CUSTOM) - set(steps[0])  # rewards/<name>/*, log_metric's 'accuracy', ...
    completions = tmp_path / "out" / "completions"  # log_completions: TRL's parquet tables
    assert sorted(p.name for p in completions.iterdir())[:1] == ["completions_00001.parquet"]


@pytest.mark.slow
def test_trl_agent_with_tools_and_an_environment(model_dir, tmp_path):
    history = logged(run(ported("agent.py", tmp_path), model_dir, tmp_path))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_AGENT) - set(steps[0])  # the environment's reward, the tool metrics


@pytest.mark.slow
def test_trl_command_line_settings(model_dir, tmp_path):
    args = [
        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "12", "--max_steps", "2", "--logging_steps", "1", "--loss_type", "cispo",
        "--epsilon_high", "5.0", "--scale_rewards", "none", "--beta", "0.01", "--use_bias_correction_kl",
        "False", "--report_to", "none", "--bf16", "False", "--gradient_checkpointing", "False",
        "--generation_kwargs", '{"suppress_tokens": [5]}', "--chat_template_kwargs", '{"enable_thinking": false}',
        "--shuffle_dataset", "False", "--seed", "3",
    ]  # fmt: skip
    history = logged(run(ported("cli.py", tmp_path), model_dir, tmp_path, *args))
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 2
    assert not set(TRL_LOGGED_CLI) - set(steps[0])
