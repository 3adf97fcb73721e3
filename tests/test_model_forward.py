"""Fixed-shape decoding through the model's own forward (`model_forward.StaticForwardDecoder`)
against our shrinking loop through the same forward (`TransformersDecoder`).

On the CPU the fixed-shape steps run eagerly and must sample the loop's tokens for the same seed,
log-probs within 1e-5 (float32), for models `LlamaDecoder` does not serve (GPT-2, Qwen2 with its
attention biases). Capturing is replaced by `EagerCapture` (conftest) or by `SyncCheck`, which runs
the captured step as transformers sees it during a CUDA capture and fails on any host
synchronisation (what makes a capture fail on a GPU). The `cuda` tests replay real CUDA graphs.
"""

import importlib.util
import logging

import pytest
import torch
import transformers.utils.import_utils
from conftest import EagerCapture
from peft import LoraConfig
from test_fixed_shape import (
    LENGTH_KNOBS,
    NGRAM_KNOBS,
    assert_same_rollout,
    check_refreshed_weights_reach_the_replay,
    decode_both,
    lora_policy,
    prompts,
    sampling,
)
from tiny_models import LLAMA_LIKE, tiny_gpt2, tiny_llama, tiny_mistral, tiny_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_helpers import chat_dataset, length_reward, make_config
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.engine import fixed_shape
from grpo_hf.engine.decoding import FIXED_SHAPE_DECODERS, decoder_for
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.local import generate
from grpo_hf.engine.model_forward import StaticForwardDecoder, TransformersDecoder, static_cache_problem

FORWARD = ("transformers", "transformers_static")  # the shrinking loop, the fixed-shape path
COMPILED = ("transformers", "transformers_compiled")  # the shrinking loop, the compiled fixed-shape path
# every logits processor of the loop, sampled
EVERY_PROCESSOR = {"top_p": 0.9, "repetition_penalty": 1.2, **LENGTH_KNOBS, **NGRAM_KNOBS, "do_sample": True}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def tiny_qwen2() -> Qwen2ForCausalLM:
    """Biases on q/k/v: not a model `LlamaDecoder` reproduces."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=259, **LLAMA_LIKE))


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"do_sample": False, "eos_token_id": [2]},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
        {"min_p": 0.05, "repetition_penalty": 1.3},
        LENGTH_KNOBS,
        NGRAM_KNOBS,
    ],
    ids=["plain", "greedy", "top-k-top-p", "min-p-repetition", "length-eta", "n-grams"],
)
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_qwen2, tiny_llama], ids=["gpt2", "qwen2", "llama"])
def test_fixed_shapes_sample_the_loops_tokens(build, knobs):
    model, (ids, mask) = build().eval(), prompts()
    assert type(decoder_for(model, 16, "transformers_static")) is StaticForwardDecoder
    loop, fixed = decode_both(model, sampling(**knobs), ids, mask, backends=FORWARD)
    assert_same_rollout(fixed, loop)
    lengths = loop.completion_mask.sum(1)
    if knobs.get("do_sample", True):  # rows end at different steps
        assert len(set(lengths.tolist())) >= 3, lengths


def lora_gpt2():
    """A tiny GPT-2 with LoRA on its attention and MLP (Conv1D) layers, B matrices non-zero."""
    return lora_policy(tiny_gpt2(), ["c_attn", "c_fc"])


def test_one_capture_per_bucket_and_the_warm_up_steps_leave_no_trace(eager_graphs):
    """The capture's warm-up runs steps on the bucket's cache (their lengths advance); the next
    call's tokens are still the loop's, in the bucket captured and in a new one."""
    model = tiny_qwen2().eval()
    rounds = [(prompts(7), 1), (prompts(9), 1), (prompts(20), 2), (prompts(7), 2)]
    for seed, ((ids, mask), captures) in enumerate(rounds):
        loop, fixed = decode_both(model, sampling(top_p=0.9), ids, mask, seed, FORWARD)
        assert_same_rollout(fixed, loop)
        assert eager_graphs.captures == captures
    assert list(fixed_shape.buffers_of(model).states) == [(8, 32, 16), (8, 16, 16)]


def test_both_kinds_of_fixed_shape_decoder_share_a_models_buckets(eager_graphs):
    """A Llama decoded by `StaticLlamaDecoder` and through its own forward in the same bucket: each
    kind keeps its own cache and graph, and both sample the loop's tokens."""
    model, (ids, mask) = tiny_llama().eval(), prompts()
    for seed, backend in enumerate(("llama_static", "transformers_static", "llama_static")):
        rollouts = []
        for each in ("transformers", backend):
            torch.manual_seed(seed)
            rollouts.append(generate(model, ids, mask, sampling(), each))
        assert_same_rollout(rollouts[1], rollouts[0])
    (state,) = fixed_shape.buffers_of(model).states.values()
    assert eager_graphs.captures == 2 and len(state.decoders) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_weights_refreshed_between_rounds_reach_the_replayed_step(device, request):
    """A LoRA GPT-2's generation copy (its float32 one-token attention, `decode_attention`), its
    attention or its MLP adapters moved per round (`check_refreshed_weights_reach_the_replay`)."""
    if device == "cpu":
        request.getfixturevalue("eager_graphs")
    check_refreshed_weights_reach_the_replay(lora_gpt2().to(device), device, FORWARD, ("c_attn", "c_fc"))


@pytest.mark.cuda
def test_refreshed_weights_reach_the_compiled_step_replayed_as_a_cuda_graph():
    """Inductor's kernels captured as the step's CUDA graph, greedy in float32: the shrinking loop's
    tokens, round after round, with refreshed LoRA weights."""
    check_refreshed_weights_reach_the_replay(lora_gpt2().to("cuda"), "cuda", COMPILED, ("c_attn", "c_fc"))


SYNCING_OPS = {
    "_local_scalar_dense",
    "is_nonzero",  # bool(t) under inference mode (the fixed-shape step's), seen before it decomposes
    "item",  # t.item() under inference mode
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
}


class HostReads(TorchDispatchMode):
    """Records the ops that read a device tensor's values on the host (`.item()`, `bool(t)`, ...) or
    size their output by them: each is a synchronisation, which a CUDA capture refuses."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname in SYNCING_OPS:
            self.seen.append(func._opname)
        return func(*args, **(kwargs or {}))


class SyncCheck(EagerCapture):
    """`EagerCapture` whose captured step runs as transformers sees a CUDA capture (its
    `is_tracing` true: the branches it takes to avoid host reads), recording host reads."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.monkeypatch, self.seen = monkeypatch, []

    def __call__(self, run_step, device):
        replay = super().__call__(run_step, device)
        with self.monkeypatch.context() as patch, HostReads() as reads:
            patch.setattr(transformers.utils.import_utils, "is_cuda_stream_capturing", lambda: True)
            run_step()
        self.seen += reads.seen
        return replay


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_the_host_read_check_sees_a_host_read(inference):
    """Under inference mode (where the fixed-shape steps run) the reads show as other ops."""
    tensor = torch.tensor([1, 0])
    with torch.inference_mode(inference), HostReads() as reads:
        bool(tensor.any()), tensor.sum().item(), tensor.nonzero()
    assert len(reads.seen) == 3 and reads.seen[-1] == "nonzero", reads.seen


@pytest.mark.parametrize(
    "build, backend",
    [(tiny_gpt2, "transformers_static"), (tiny_qwen2, "transformers_static"), (tiny_llama, "llama_static")],
    ids=["gpt2", "qwen2", "llama"],
)
@pytest.mark.parametrize("copy", [False, True], ids=["model", "generation-copy"])
def test_the_captured_step_reads_nothing_back_to_the_host(build, backend, copy, monkeypatch):
    """The whole step, the model's forward, its masks and the sampling with every logits processor,
    makes no host read: a CUDA capture of it does not fail for want of one (the generation copy's
    one-token attention too)."""
    check = SyncCheck(monkeypatch)
    monkeypatch.setattr(fixed_shape, "graphs_enabled", lambda device: True)
    monkeypatch.setattr(fixed_shape, "capture", check)
    model = GenerationCopy(build(), torch.float32).refresh() if copy else build().eval()
    generate(model, *prompts(), sampling(**EVERY_PROCESSOR), backend)
    assert check.captures == 1 and check.seen == []


def test_which_models_decode_in_fixed_shapes():
    assert static_cache_problem(tiny_gpt2()) is None and static_cache_problem(tiny_qwen2()) is None
    assert "sliding-window" in static_cache_problem(tiny_mistral())
    assert "not a transformers model" in static_cache_problem(lora_gpt2())
    assert type(decoder_for(tiny_gpt2(), 3)) is TransformersDecoder  # the CPU default: rows leave as they end
    assert type(decoder_for(tiny_mistral(), 3, "transformers")) is TransformersDecoder
    with pytest.raises(ValueError, match=r"'transformers_static' cannot decode this model: .*sliding-window"):
        decoder_for(tiny_mistral(), 3, "transformers_static")
    config = GRPOConfig(output_dir="unused", generation_backend="transformers_static")
    assert config.generation_backend == "transformers_static"


def test_a_failed_capture_names_the_setting_that_avoids_it(failing_capture):
    with pytest.raises(
        RuntimeError,
        match=r"CUDA graph failed \(operation not permitted.*'transformers_static' to decode without "
        r"torch.compile, or 'transformers' without CUDA graphs",
    ):
        generate(tiny_gpt2().eval(), *prompts(), sampling(), "transformers_static")


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_auto_goes_on_with_the_loop_after_a_failed_capture(build, monkeypatch, caplog, failing_capture):
    """Where steps are captured (a GPU; here `graphs_enabled` says so), 'auto' decodes in fixed
    shapes. A failed capture is a warning, not the end of the run: the call's tokens are the
    shrinking loop's for the same seed, and later calls decode with the loop without capturing."""
    model, (ids, mask) = build().eval(), prompts()
    torch.manual_seed(0)
    loop = generate(model, ids, mask, sampling(), "llama" if build is tiny_llama else "transformers")
    assert isinstance(decoder_for(model, 16), FIXED_SHAPE_DECODERS)
    for _ in range(2):
        torch.manual_seed(0)
        with caplog.at_level(logging.WARNING):
            assert_same_rollout(generate(model, ids, mask, sampling(), "auto"), loop)
    assert len(failing_capture) == 1
    assert "operation not permitted" in caplog.text and "'auto' goes on decoding this model" in caplog.text
    assert not isinstance(decoder_for(model, 16), FIXED_SHAPE_DECODERS)
    assert not fixed_shape.buffers_of(model).states  # the buckets' memory freed


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_qwen2], ids=["gpt2", "qwen2"])
def test_the_compiled_forward_samples_the_loops_tokens(build, cheap_compile, eager_graphs):
    """'transformers_compiled': the model's forward traced by dynamo (one graph, no breaks: one
    frame) samples the loop's tokens, round after round, from one capture."""
    model = build().eval()
    assert decoder_for(model, 16, "transformers_compiled").compiled
    for seed in range(3):
        loop, compiled = decode_both(model, sampling(top_p=0.9), *prompts(), seed, COMPILED)
        assert_same_rollout(compiled, loop)
    assert cheap_compile.frame_count == 1 and eager_graphs.captures == 1


def test_weights_refreshed_between_rounds_reach_the_compiled_step(cheap_compile, eager_graphs):
    """The refreshed LoRA weights are inputs of the compiled code, not constants baked in at the
    first round: no compiling again, and the new weights' tokens."""
    check_refreshed_weights_reach_the_replay(lora_gpt2(), "cpu", COMPILED, ("c_attn", "c_fc"))
    assert cheap_compile.frame_count == 1


def test_new_prompt_buckets_reuse_the_compiled_forward(inductor_compile, eager_graphs):
    """Four prompt-width buckets and back, through inductor: two compilations (the first bucket's
    static shapes, then the cache width symbolic, which transformers' mask code takes), and the
    compiled forward samples the loop's tokens in every one (the way back in the 32-column bucket)."""
    model = tiny_qwen2().eval()
    for width in (7, 20, 40, 70, 9):
        loop, compiled = decode_both(model, sampling(top_p=0.9), *prompts(width), width, COMPILED)
        assert_same_rollout(compiled, loop)
    assert inductor_compile.frame_count == 2
    assert eager_graphs.captures == 4  # the way back runs in the 32-column bucket (held, within MAX_WASTE)


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no-triton"])
def test_auto_compiles_the_forward_where_triton_is_installed(triton, eager_graphs, monkeypatch):
    """Where steps are captured (a GPU; here `graphs_enabled` says so) auto compiles the fixed-shape
    forward when Triton, inductor's GPU code generator, is installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (triton or None) if name == "triton" else find_spec(name, *a),
    )
    decoder = decoder_for(tiny_qwen2(), 16)
    assert type(decoder) is StaticForwardDecoder and decoder.compiled is triton
    assert not decoder_for(tiny_qwen2(), 16, "transformers_static").compiled


@pytest.mark.cuda
def test_auto_takes_the_fixed_shape_forward_on_a_gpu_where_transformers_allows_it():
    decoder = decoder_for(tiny_qwen2().to("cuda"), 3)
    assert type(decoder) is StaticForwardDecoder
    assert decoder.compiled is (importlib.util.find_spec("triton") is not None)
    assert type(decoder_for(tiny_mistral().to("cuda"), 3)) is TransformersDecoder  # sliding window


@pytest.mark.cuda
@pytest.mark.parametrize("backend", FORWARD[1:] + COMPILED[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_qwen2], ids=["gpt2", "qwen2"])
def test_cuda_graph_replay_equals_the_eager_steps(build, dtype, backend, monkeypatch):
    """Replayed as a CUDA graph, round after round and across two prompt buckets, the step (every
    logits processor in it) gives the tokens and log-probs of the same steps (compiled or not) run
    without the graph."""
    model = build().to("cuda", dtype).eval()
    for seed, width in enumerate((7, 9, 20, 7)):
        ids, mask = prompts(width, device="cuda")
        torch.manual_seed(seed)
        replayed = generate(model, ids, mask, sampling(**EVERY_PROCESSOR), backend)
        with monkeypatch.context() as patch:
            patch.setattr(fixed_shape, "graphs_enabled", lambda device: False)
            torch.manual_seed(seed)
            eager = generate(model, ids, mask, sampling(**EVERY_PROCESSOR), backend)
        assert_same_rollout(replayed, eager)
    assert all(len(state.graphs) == 1 for state in fixed_shape.buffers_of(model).states.values())


def test_a_lora_gpt2_trains_alike_with_each_decoder(tmp_path, cheap_compile):
    """Two steps of GRPO on a LoRA GPT-2 (its merged generation copy decodes): the fixed-shape
    forward, compiled or not, samples the shrinking loop's completions, so the runs log the same
    rewards and lengths and end with the same adapters (up to float32 rounding of the sampler's
    log-probs)."""
    runs = []
    for backend in (*FORWARD, "transformers_compiled"):
        trainer = GRPOTrainer(
            model=tiny_gpt2(),
            reward_funcs=length_reward,
            args=make_config(tmp_path / backend, generation_backend=backend),
            train_dataset=chat_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]),
        )
        trainer.train()
        logs = [
            (log["reward"], log["completions/mean_length"])
            for log in trainer.state.log_history
            if "reward" in log
        ]
        adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        runs.append((logs, adapters))
    (loop_logs, loop_adapters), *fixed_runs = runs
    for fixed_logs, fixed_adapters in fixed_runs:
        assert len(fixed_logs) == 2 and fixed_logs == loop_logs
        torch.testing.assert_close(fixed_adapters, loop_adapters, rtol=0, atol=1e-5)
    assert cheap_compile.frame_count == 1
