"""Tests marked `cuda` need a CUDA GPU: skipped, saying so, where there is none. The `eager_graphs`
and `failing_capture` fixtures stand in for the fixed-shape decoders' CUDA graph capture on the CPU."""

import pytest
import torch

from grpo_hf.engine import fixed_shape


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class EagerCapture:
    """Stands in for `fixed_shape.capture` on the CPU: runs the warm-up steps on the state as the
    real capture does, counts captures, and replays the step eagerly."""

    def __init__(self):
        self.captures = 0

    def __call__(self, run_step, device):
        self.captures += 1
        for _ in range(fixed_shape.WARMUP_STEPS):
            run_step()
        return run_step


@pytest.fixture
def eager_graphs(monkeypatch) -> EagerCapture:
    capture = EagerCapture()
    monkeypatch.setattr(fixed_shape, "graphs_enabled", lambda device: True)
    monkeypatch.setattr(fixed_shape, "capture", capture)
    return capture


@pytest.fixture
def failing_capture(monkeypatch) -> list:
    """Steps are captured (as on a GPU) and every capture fails as a refused operation would; the
    list holds each attempt's device."""
    attempts = []

    def capture(run_step, device):
        attempts.append(device)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fixed_shape, "graphs_enabled", lambda device: True)
    monkeypatch.setattr(fixed_shape, "capture", capture)
    return attempts
