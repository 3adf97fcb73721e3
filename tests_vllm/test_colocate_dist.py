"""Item d, colocate: two training processes over gloo (DDP on the CPU), each with its own in-process
vLLM engine (external_launcher over the trainer's process group)."""

import json

import pytest
from conftest import ROOT
from helpers import SAMPLER_GAP, assert_ratios_near_one
from two_processes import launch_two_processes

from grpo_hf.engine.cpu import native_bf16


@pytest.mark.cpu_kind
def test_two_processes_each_with_an_engine(tmp_path):
    """At the machine's precision: each engine and each log-prob pass in bf16 where the CPU has it."""
    launch_two_processes(ROOT / "tests_vllm" / "colocate_worker.py", [str(tmp_path)], tmp_path, timeout=900)
    zero, one = (json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2))
    for report in (zero, one):
        assert report["bf16"] == native_bf16()
        assert report["gap"] < SAMPLER_GAP[report["bf16"]]  # each engine samples from its process's policy
        assert len(report["ratios"]) == 2
        assert_ratios_near_one(report["ratios"], report["ratio_maxes"], report["bf16"])
        assert report["version"] == 1  # weights sent before each of the two steps' rounds
    assert zero["completions"] != one["completions"]  # each process generated its own prompt
    assert zero["lora_B_sum"] == one["lora_B_sum"] != 0.0  # DDP: one trained adapter, moved from 0
