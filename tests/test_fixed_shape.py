"""The fixed-shape decoder (`StaticLlamaDecoder`, `engine/fixed_shape.py`) against our shrinking loop.

On the CPU it runs eagerly and must sample the loop's tokens for the same seed, with log-probs
within 1e-5 (float32). The CUDA graph bookkeeping (one capture per bucket and sampling settings,
captured again when a weight moves) runs here with the capture replaced by conftest's
`EagerCapture`, which runs the warm-up steps on the state as a real capture does. The tests marked
`cuda` (skipped without a GPU) replay real CUDA graphs.
"""

import importlib.util
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_decoding import llama_with_rope_scaling
from tiny_models import tiny_llama, tiny_tokenizer
from transformers import GenerationConfig

from grpo_hf import GRPOConfig
from grpo_hf.data.rollout import Rollout, completion_mask_after_eos
from grpo_hf.engine import fixed_shape
from grpo_hf.engine.decoding import LlamaDecoder, StaticLlamaDecoder, decoder_for
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.local import generate
from grpo_hf.episodes.multi_turn import tool_episodes
from grpo_hf.episodes.tools import tool_registry

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prompts(width: int = 7, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Six left-padded rows, three prompts twice each (lengths width, 3 and 1): 8 rows and
    16 columns in buckets, so both kinds of bucket padding are exercised."""
    rows = [list(range(40, 40 + width)), [0] * (width - 3) + [9, 8, 7], [0] * (width - 1) + [4]]
    ids = torch.tensor([row for row in rows for _ in range(2)], device=device)  # (6, width)
    return ids, (ids != 0).long()


def sampling(**knobs) -> GenerationConfig:
    """16 new tokens; 27 of the 259 tokens end a completion, so rows end at different steps."""
    settings = dict(do_sample=True, max_new_tokens=16, pad_token_id=0, eos_token_id=list(range(3, 30)))
    return GenerationConfig(**(settings | knobs))


def decode_both(model, config, ids, mask, seed: int = 0, backends=("llama", "llama_static")):
    """The shrinking loop's rollout and the fixed-shape one's (`backends`), each drawn from `seed`."""
    rollouts = []
    for backend in backends:
        torch.manual_seed(seed)
        rollouts.append(generate(model, ids, mask, config, backend))
    return rollouts


def assert_same_rollout(ours, reference):
    assert torch.equal(ours.completion_ids, reference.completion_ids)
    assert torch.equal(ours.completion_mask, reference.completion_mask)
    torch.testing.assert_close(ours.sampler_logps, reference.sampler_logps, rtol=0, atol=1e-5)


# The settings the loop's processors read its sequence's length or last tokens for. Each bites on
# both tiny Llamas (`test_the_length_and_ngram_settings_bite`): a row of `prompts()` ends after 4
# tokens and others sooner than 6, greedy decoding repeats pairs of tokens (258 148 ...) or one (176).
LENGTH_KNOBS = {"min_new_tokens": 6, "suppress_tokens": [37, 251], "eta_cutoff": 0.5}
NGRAM_KNOBS = {
    "do_sample": False,
    "eos_token_id": [2],
    "no_repeat_ngram_size": 2,
    "bad_words_ids": [[258, 148], [31, 62, 60], [176]],
}


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"do_sample": False, "eos_token_id": [2]},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
        {"min_p": 0.05, "repetition_penalty": 1.3},
        {"typical_p": 0.9, "epsilon_cutoff": 1e-3, "repetition_penalty": 0.8},
        LENGTH_KNOBS,
        NGRAM_KNOBS,
    ],
    ids=["plain", "greedy", "top-k-top-p", "min-p-repetition", "typical-epsilon", "length-eta", "n-grams"],
)
@pytest.mark.parametrize("build", [tiny_llama, llama_with_rope_scaling], ids=["llama", "llama3-rope-gqa"])
def test_fixed_shapes_sample_the_loops_tokens(build, knobs):
    model, (ids, mask) = build().eval(), prompts()
    loop, fixed = decode_both(model, sampling(**knobs), ids, mask)
    assert_same_rollout(fixed, loop)
    lengths = loop.completion_mask.sum(1)
    if knobs.get("do_sample", True):  # rows end at different steps
        assert len(set(lengths.tolist())) >= 3, lengths


@pytest.mark.parametrize("build", [tiny_llama, llama_with_rope_scaling], ids=["llama", "llama3-rope-gqa"])
def test_the_length_and_ngram_settings_bite(build):
    """The loop's own tokens under LENGTH_KNOBS and NGRAM_KNOBS differ from those without them, and
    hold what each setting promises (so the fixed-shape path equalling them tests its processors)."""
    model, (ids, mask) = build().eval(), prompts()
    for knobs, base in ((LENGTH_KNOBS, {}), (NGRAM_KNOBS, {"do_sample": False, "eos_token_id": [2]})):
        (free,), (held,) = (
            decode_both(model, sampling(**k), ids, mask, backends=("llama",)) for k in (base, knobs)
        )
        assert not torch.equal(free.completion_ids, held.completion_ids)
    (held,) = decode_both(model, sampling(**LENGTH_KNOBS), ids, mask, backends=("llama",))
    assert (
        held.completion_mask.sum(1).min() >= 7  # no EOS among the first 6 tokens
        and not torch.isin(held.completion_ids, torch.tensor([37, 251])).any()
    )
    (held,) = decode_both(model, sampling(**NGRAM_KNOBS), ids, mask, backends=("llama",))
    for prompt, completion in zip(ids.tolist(), held.completion_ids.tolist(), strict=True):
        sequence = prompt + completion  # the (padded) prompt may repeat a pair; no drawn token does
        for j in range(len(prompt), len(sequence)):
            assert (sequence[j - 1], sequence[j]) not in {tuple(sequence[i : i + 2]) for i in range(j - 1)}
        for word in ([258, 148], [31, 62, 60], [176]):
            ends_drawn = range(len(prompt) - len(word) + 1, len(sequence) - len(word) + 1)
            assert all(sequence[i : i + len(word)] != word for i in ends_drawn)


def test_the_bucket_columns_before_the_prompt_are_not_the_loops_sequence():
    """They repeat the row's last prompt token: row 0 of 3-column prompts, 40 41 42, sits in 16
    columns as 42 x 13, 40, 41, 42. A bad word longer than the prompt is skipped by the loop until
    enough tokens are drawn; those columns must not complete it, nor n-grams of them ban tokens."""
    model, (ids, mask) = tiny_llama().eval(), prompts(3)
    greedy = {"do_sample": False, "eos_token_id": [2]}
    (free,) = decode_both(model, sampling(**greedy), ids, mask, backends=("llama",))
    first = free.completion_ids[0, 0].item()
    for knobs in (
        {"bad_words_ids": [[42, 40, 41, 42, first]]},
        {"no_repeat_ngram_size": 2},
        {"no_repeat_ngram_size": 40},  # longer than the bucket's 32 columns
    ):
        loop, fixed = decode_both(model, sampling(**greedy, **knobs), ids, mask)
        assert loop.completion_ids[0, 0] == first
        assert_same_rollout(fixed, loop)


def test_a_replayed_step_reads_each_calls_prompt_width(eager_graphs):
    """Prompts of 7, 5 and 11 columns share a bucket of 16 and one capture; the length and n-gram
    settings, which read where the call's prompt starts, give the loop's tokens in each call."""
    model = tiny_llama().eval()
    for knobs in (LENGTH_KNOBS, NGRAM_KNOBS):
        for width in (7, 5, 11):
            loop, fixed = decode_both(model, sampling(**knobs), *prompts(width))
            assert_same_rollout(fixed, loop)
    assert eager_graphs.captures == 2  # one per sampling settings


def lora_policy(model: torch.nn.Module | None = None, targets: list[str] = LORA_TARGETS) -> torch.nn.Module:
    """A tiny model (a Llama, LoRA on every linear layer, by default) with LoRA on `targets`, its B
    matrices non-zero (trained)."""
    model = tiny_llama() if model is None else model
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return policy


def test_the_lora_merged_generation_copy_decodes_alike():
    copy = GenerationCopy(lora_policy(), torch.float32)
    ids, mask = prompts()
    loop, fixed = decode_both(copy.refresh(), sampling(top_k=50), ids, mask, seed=3)
    assert_same_rollout(fixed, loop)


def test_the_fixed_shape_steps_ignore_an_ambient_autocast():
    """Decoding runs without autocast, as the shrinking loop is written for; a captured step must
    not read autocast's cached weight casts (freed when the autocast region ends)."""
    model, (ids, mask) = tiny_llama().eval(), prompts()
    torch.manual_seed(0)
    plain = generate(model, ids, mask, sampling(), "llama_static")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        under = generate(model, ids, mask, sampling(), "llama_static")
    assert_same_rollout(under, plain)


def test_one_capture_per_bucket_and_sampling_settings(eager_graphs):
    model = tiny_llama().eval()
    rounds = [
        (prompts(7), sampling(), 1),  # 8 rows x 16 prompt columns x 16 new: captured
        (prompts(9), sampling(), 1),  # a longer prompt in the same bucket: replayed
        (prompts(9), sampling(max_new_tokens=12), 1),  # fewer new tokens, same bucket: replayed
        (prompts(20), sampling(), 2),  # 32 prompt columns: a new bucket
        (prompts(9), sampling(do_sample=False), 3),  # greedy: other settings baked in
        (prompts(9), sampling(), 3),  # back to the first: still held
    ]
    for seed, ((ids, mask), config, captures) in enumerate(rounds):
        loop, fixed = decode_both(model, config, ids, mask, seed)
        assert_same_rollout(fixed, loop)
        assert eager_graphs.captures == captures
    assert list(fixed_shape.buffers_of(model).states) == [(8, 32, 16), (8, 16, 16)]  # most recent last


def test_a_call_runs_in_a_larger_bucket_held_already(eager_graphs):
    """Fewer rows and a narrower prompt than a held bucket's, within MAX_WASTE of its cells: decoded
    there (no capture, no new bucket) with the loop's tokens; a call 8 times smaller gets its own."""
    model = tiny_llama().eval()
    ids, mask = prompts(20)  # 8 rows x 32 prompt columns x 16 new
    decode_both(model, sampling(), ids, mask)
    loop, fixed = decode_both(model, sampling(max_new_tokens=9), ids[:3, -7:], mask[:3, -7:], seed=1)
    assert_same_rollout(fixed, loop)
    assert eager_graphs.captures == 1 and list(fixed_shape.buffers_of(model).states) == [(8, 32, 16)]
    decode_both(model, sampling(), ids[:1, -7:], mask[:1, -7:])  # 1 x 16 x 16: 1/6 of the cells
    assert eager_graphs.captures == 2


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def test_the_turns_of_multi_turn_episodes_share_captured_steps(eager_graphs):
    """Tool episodes of 1 to 6 turns (row k calls the tool k - 1 times) over a 512-token budget: each
    turn has fewer rows, a longer prompt and less budget, 5 buckets of their own, more than a model
    holds (MAX_STATES), so each turn captured its step again, round after round. Now the first round
    captures 4 times (the first turn's bucket goes for the fourth; the first turn then fits in the
    second's), the second round none, and every turn samples the shrinking loop's tokens."""
    tokenizer, model = tiny_tokenizer(), tiny_llama().eval()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    own_buckets = set()

    def turn(ids, mask, max_new_tokens):
        own_buckets.add((fixed_shape.bucket(len(ids), 1), fixed_shape.bucket(ids.shape[1]), max_new_tokens))
        loop, fixed = decode_both(model, sampling(max_new_tokens=max_new_tokens), ids, mask, len(own_buckets))
        assert_same_rollout(fixed, loop)
        rows = []  # the scripted turns: row k calls the tool until it has k - 1 results, then answers
        for context, row_mask in zip(ids, mask, strict=True):
            text = tokenizer.decode(context[row_mask.bool()])
            calls_left = int(re.search(r"row(\d)", text).group(1)) - text.count("<|im_start|>tool")
            tokens = tokenizer(call if calls_left > 0 else "5", add_special_tokens=False)["input_ids"]
            tokens = (tokens + [tokenizer.eos_token_id])[:max_new_tokens]
            rows.append(tokens + [0] * (max_new_tokens - len(tokens)))
        completion_ids = torch.tensor(rows)  # (B, C)
        return Rollout(
            ids, mask, completion_ids, *completion_mask_after_eos(completion_ids, [tokenizer.eos_token_id])
        )

    captures = []
    for _ in range(2):
        before = eager_graphs.captures
        prompts = [[{"role": "user", "content": f"row{k}: 2 + 3?"}] for k in range(1, 9)]
        tool_episodes(
            prompts, [tool_registry([add])] * 8, [[]] * 8, tokenizer, turn, max_prompt_length=None,
            max_iterations=None, max_completion_length=512, timeout=5.0, device=torch.device("cpu"),
        )  # fmt: skip
        captures.append(eager_graphs.captures - before)
    assert len({(rows, width, fixed_shape.bucket(n)) for rows, width, n in own_buckets}) == 5
    assert captures == [4, 0]


def check_refreshed_weights_reach_the_replay(
    policy, device: str, backends: tuple[str, str], moved: tuple, quantization: str | None = None
):
    """`policy`'s generation copy (quantized as `quantization` says), refreshed in place after each
    'optimizer step' that moves the LoRA B matrices of one of `moved`: the fixed-shape backend's
    (`backends[1]`) replayed greedy tokens change, and are those of eager steps on the new weights
    and of the shrinking loop (`backends[0]`). A step that read stale weights would repeat the
    previous round's tokens."""
    loop_backend, backend = backends
    copy = GenerationCopy(policy, torch.float32, quantization=quantization)
    ids, mask = prompts(device=device)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=[2])
    previous = generate(copy.refresh(), ids, mask, config, backend).completion_ids
    numbers = torch.Generator().manual_seed(0)  # on the CPU: the same steps on every device
    for kind in moved:
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if f"{kind}.lora_B" in name:
                    param.add_(torch.randn(param.shape, generator=numbers).to(device))
        copy.refresh()
        replayed = generate(copy.model, ids, mask, config, backend).completion_ids
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fixed_shape, "graphs_enabled", lambda device: False)
            eager = generate(copy.model, ids, mask, config, backend).completion_ids
        loop = generate(copy.model, ids, mask, config, loop_backend).completion_ids
        assert torch.equal(replayed, eager) and torch.equal(replayed, loop), kind
        assert not torch.equal(replayed, previous), kind
        previous = replayed


@pytest.mark.parametrize("device", DEVICES)
def test_weights_refreshed_between_rounds_reach_the_replayed_step(device, request):
    """A LoRA Llama, one kind of adapter moved per round: a joined q/k/v or gate/up buffer, or a
    weight read where it lies."""
    if device == "cpu":
        request.getfixturevalue("eager_graphs")
    moved = ("q_proj", "o_proj", "gate_proj", "down_proj")
    check_refreshed_weights_reach_the_replay(
        lora_policy().to(device), device, ("llama", "llama_static"), moved
    )


def test_a_weight_replaced_by_a_new_tensor_is_captured_again(eager_graphs):
    model = tiny_llama().eval().requires_grad_(False)
    ids, mask = prompts()
    config = sampling()
    decode_both(model, config, ids, mask)
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.randn_like(down.weight), requires_grad=False)
    loop, fixed = decode_both(model, config, ids, mask, seed=1)
    assert_same_rollout(fixed, loop)
    assert eager_graphs.captures == 2


def test_a_failed_capture_names_the_setting_that_avoids_it(failing_capture):
    ids, mask = prompts()
    with pytest.raises(
        RuntimeError, match=r"CUDA graph failed \(operation not permitted.*'llama_static'.*or 'llama' without"
    ):
        generate(tiny_llama().eval(), ids, mask, sampling(), "llama_static")


def test_joined_weights_are_rewritten_in_place():
    q, k = torch.ones(2, 3), torch.zeros(1, 3)
    joins = fixed_shape.JoinedWeights()
    (qk,) = joins.join([(q, k)])
    assert joins.join([(k,)]) == [k]  # a group of one is its weight
    (again,) = joins.join([(q, k)])  # q/k's entry was dropped with the call that did not ask for it
    k.add_(5)  # in place: the version counter moves
    (after,) = joins.join([(q, k)])
    assert after is again and after.data_ptr() == again.data_ptr() and after[2].tolist() == [5, 5, 5]
    assert qk.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]  # a buffer once dropped keeps its values


def test_the_buckets_and_the_processor_sequence():
    assert [fixed_shape.bucket(n) for n in (1, 16, 17, 100, 256, 257)] == [16, 16, 32, 128, 256, 512]
    assert [fixed_shape.bucket(n, least=1) for n in (1, 2, 3, 6, 8)] == [1, 2, 4, 8, 8]
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    sequence = fixed_shape.processor_sequence(ids, rows=4, width=5, new_tokens=2)
    assert sequence.tolist() == [
        [6, 6, 0, 5, 6, 6, 6],  # bucket padding and new-token columns repeat the last prompt token
        [9, 9, 7, 8, 9, 9, 9],
        [9, 9, 7, 8, 9, 9, 9],  # the bucket's spare rows copy the last row
        [9, 9, 7, 8, 9, 9, 9],
    ]


def test_generation_backend_llama_static_is_a_choice():
    model = tiny_llama()
    assert type(decoder_for(model, 3, "llama_static")) is StaticLlamaDecoder
    assert type(decoder_for(model, 3)) is LlamaDecoder  # the CPU default: rows leave as they end
    assert (
        GRPOConfig(output_dir="unused", generation_backend="llama_static").generation_backend
        == "llama_static"
    )


@pytest.mark.cuda
def test_auto_takes_the_fixed_shape_decoder_on_a_gpu():
    model = tiny_llama().to("cuda")
    assert type(decoder_for(model, 3)) is StaticLlamaDecoder
    assert decoder_for(model, 3).compiled is (importlib.util.find_spec("triton") is not None)
    assert type(decoder_for(model, 3, "llama")) is LlamaDecoder


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "knobs", [{}, {"do_sample": False}, {"top_p": 0.9, "repetition_penalty": 1.2}, LENGTH_KNOBS, NGRAM_KNOBS]
)
def test_cuda_graph_replay_equals_the_eager_steps(dtype, knobs, monkeypatch):
    """On a GPU the fixed-shape decoder replays its step as a CUDA graph; the same steps run eagerly
    give the same tokens and log-probs, round after round."""
    model = tiny_llama().to("cuda", dtype).eval().requires_grad_(False)
    ids, mask = prompts(device="cuda")
    config = sampling(**knobs)
    assert type(decoder_for(model, 16, "llama_static")) is StaticLlamaDecoder
    for seed in range(3):  # the first round captures, the next ones replay
        torch.manual_seed(seed)
        replayed = generate(model, ids, mask, config, "llama_static")
        with monkeypatch.context() as patch:
            patch.setattr(fixed_shape, "graphs_enabled", lambda device: False)
            torch.manual_seed(seed)
            eager = generate(model, ids, mask, config, "llama_static")
        assert_same_rollout(replayed, eager)
    (state,) = fixed_shape.buffers_of(model).states.values()
    assert len(state.graphs) == 1 and state.capture_seconds > 0


def train_q_adapter(policy, copy: GenerationCopy) -> None:
    """An 'optimizer step' on the policy's q_proj adapters, then the generation copy refreshed."""
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "q_proj.lora_B" in name:
                param.add_(1.0)
    copy.refresh()


def compiled_as_static(model, ids, mask, seed: int) -> Rollout:
    """The prompts sampled from `seed` by 'llama_static', then by 'llama_compiled', checked to be the
    same rollout; the compiled one."""
    rollouts = []
    for backend in ("llama_static", "llama_compiled"):
        torch.manual_seed(seed)
        rollouts.append(generate(model, ids, mask, sampling(top_p=0.9), backend))
    assert_same_rollout(rollouts[1], rollouts[0])
    return rollouts[1]


def test_the_compiled_step_is_the_static_step(cheap_compile, eager_graphs):
    """'llama_compiled' samples the same tokens as the static steps, round after round, and a LoRA
    policy's refreshed weights reach it (they are inputs of the compiled code, not constants)."""
    policy = lora_policy()
    copy = GenerationCopy(policy, torch.float32)
    ids, mask = prompts()
    previous = None
    for seed in range(3):
        train_q_adapter(policy, copy)
        compiled = compiled_as_static(copy.model, ids, mask, seed)
        assert previous is None or not torch.equal(compiled.completion_ids, previous.completion_ids)
        previous = compiled
    assert eager_graphs.captures == 2  # one step each: a compiled step never replays the uncompiled one
    assert type(decoder_for(copy.model, 3, "llama_compiled")) is StaticLlamaDecoder
    assert decoder_for(copy.model, 3, "llama_compiled").compiled


def test_new_prompt_buckets_reuse_the_compiled_step(inductor_compile, eager_graphs):
    """Four prompt-width buckets (16 to 128 columns) and back, through inductor: two compilations
    (the first bucket's static shapes, then the cache width symbolic), each bucket its own capture,
    the way back in a larger bucket held already, and the compiled step samples the static step's
    tokens in every one."""
    model = tiny_llama().eval()
    for width in (7, 20, 40, 70, 9):
        compiled_as_static(model, *prompts(width), seed=width)
    assert inductor_compile.frame_count == 2  # static shapes would compile once per bucket: 4
    # a capture per backend and bucket; the 16-column prompts' return runs in the 32-column bucket (held,
    # within MAX_WASTE), the 16-column one gone (MAX_STATES)
    assert eager_graphs.captures == 2 * 4


@pytest.mark.cuda
def test_the_compiled_step_replays_as_a_cuda_graph():
    """Inductor's kernels captured as the step's CUDA graph: the tokens and log-probs of the
    uncompiled steps run eagerly, round after round, with refreshed LoRA weights, in three prompt
    buckets (from the second on, the compiled code has the cache width symbolic: `compile_step`)."""
    policy = lora_policy().to("cuda")
    copy = GenerationCopy(policy, torch.float32)
    for seed, width in enumerate((7, 20, 7, 40)):
        train_q_adapter(policy, copy)
        assert_same_rollout(*compiled_replay_and_eager(copy.model, width, seed))


def compiled_replay_and_eager(model, width: int, seed: int) -> tuple[Rollout, Rollout]:
    """`prompts(width)` on CUDA sampled from `seed` by the compiled step replayed as a CUDA graph, and
    by the uncompiled step run eagerly."""
    ids, mask = prompts(width, device="cuda")
    torch.manual_seed(seed)
    replayed = generate(model, ids, mask, sampling(top_p=0.9), "llama_compiled")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fixed_shape, "graphs_enabled", lambda device: False)
        torch.manual_seed(seed)
        eager = generate(model, ids, mask, sampling(top_p=0.9), "llama_static")
    return replayed, eager
