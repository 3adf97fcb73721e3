"""`launch_two_processes`: a script under `accelerate launch` on 2 CPU processes over gloo."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import DEVICE_VARIABLE, free_port

ROOT = Path(__file__).resolve().parents[1]


def launch_two_processes(
    script: Path,
    arguments: list[str],
    output: Path,
    timeout: float = 300,
    config: str = "cpu_ddp2.yaml",
    check: bool = True,
) -> str:
    """`accelerate launch` of `script` on 2 CPU processes over gloo with recipes/accelerate/`config`;
    fails the test on a hang, and with `check` on an error. Returns the launch's output."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env[DEVICE_VARIABLE] = "cpu"  # the workers' trainers too, whatever device the suite trains on
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "recipes" / "accelerate" / config), "--main_process_port", str(free_port()),
        "--num_cpu_threads_per_process", "1", str(script), *arguments,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"2 processes hung for {timeout} s:\n{out[-4000:]}")
    (output / "launch.txt").write_text(out)
    errors = [line for line in out.splitlines() if line.startswith("[rank")][-40:]
    assert process.returncode == 0 or not check, "\n".join(errors[:20]) or out[-4000:]
    return out
