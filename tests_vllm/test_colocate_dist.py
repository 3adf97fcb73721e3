"""Item d, colocate: two training processes over gloo (DDP on the CPU), each with its own in-process
vLLM engine (external_launcher over the trainer's process group)."""

import json

from conftest import ROOT
from two_processes import launch_two_processes


def test_two_processes_each_with_an_engine(tmp_path):
    launch_two_processes(ROOT / "tests_vllm" / "colocate_worker.py", [str(tmp_path)], tmp_path, timeout=900)
    zero, one = (json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2))
    for report in (zero, one):
        assert report["gap"] < 1e-3  # each engine samples from its process's policy
        assert len(report["ratios"]) == 2 and all(abs(r - 1) < 1e-3 for r in report["ratios"])
        assert report["version"] == 1  # weights sent before each of the two steps' rounds
    assert zero["completions"] != one["completions"]  # each process generated its own prompt
    assert zero["lora_B_sum"] == one["lora_B_sum"] != 0.0  # DDP: one trained adapter, moved from 0
