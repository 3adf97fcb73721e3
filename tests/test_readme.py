"""The README's Python API example runs as written (real default model, a few steps, in a subprocess)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_example(heading: str) -> str:
    """The first python code block after a heading of the README."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def run_example(tmp_path, heading: str) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(readme_example(heading))
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_readme_example_trains_and_saves_an_adapter(tmp_path):
    done = run_example(tmp_path, "## The Python API")
    output = tmp_path / "outputs" / "api-example"
    assert (output / "adapter_model.safetensors").is_file()
    assert "'reward/ends_with_answer'" in done.stdout  # the user's reward is logged under its name


@pytest.mark.slow
def test_readme_tools_example_trains_on_episodes(tmp_path):
    done = run_example(tmp_path, "### Tools and multi-turn episodes")
    assert "'tools/calls_per_episode'" in done.stdout  # episodes ran and were logged
