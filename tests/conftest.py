"""Every test runs as on one kind of CPU, a `cpu_kind` test as both (tests/cpu_kinds.py). Tests marked
`cuda` need a CUDA GPU: skipped, saying so, where there is none. The `eager_graphs`
and `failing_capture` fixtures stand in for the fixed-shape decoders' CUDA graph capture on the CPU;
`cheap_compile` and `inductor_compile` count the compilations of their compiled steps."""

import functools

import pytest
import torch
from cpu_kinds import cpu_kind, pytest_configure, pytest_generate_tests  # noqa: F401 (the plugin's hooks)
from torch._dynamo.testing import CompileCounterWithBackend

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


def counted_compile(monkeypatch, backend: str) -> CompileCounterWithBackend:
    """The fixed-shape decoders' compiled steps (`fixed_shape.compiled_step`) through `backend`,
    counting their compilations (nothing compiled by an earlier test reused)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = functools.cache(lambda eager_forward: fixed_shape.compile_step(eager_forward, counter))
    monkeypatch.setattr(fixed_shape, "compiled_step", compiled)
    return counter


@pytest.fixture
def cheap_compile(monkeypatch) -> CompileCounterWithBackend:
    """Traced by dynamo and AOTAutograd as on a GPU, the kernels left to eager ops."""
    return counted_compile(monkeypatch, "aot_eager")


@pytest.fixture
def inductor_compile(monkeypatch) -> CompileCounterWithBackend:
    """The product's backend, inductor, generating C++ for the CPU where a GPU gets Triton (the
    lowering, symbolic shapes included, is the same; ~25 s of C++ builds here with a cold cache)."""
    return counted_compile(monkeypatch, "inductor")
