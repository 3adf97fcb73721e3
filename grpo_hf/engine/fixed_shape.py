"""Fixed-shape decoding: a static KV cache, steps that keep every row, and CUDA graphs of the step.

Our decoding loop (`local._decode`) drops rows as they finish and lets each step attend to the
columns written so far: right on a CPU, where a step costs what its rows and columns cost. On a GPU
a small model's step is kernel launches and Python (about 20 ms for SmolLM2-135M where the
arithmetic needs under 1 ms, issue 30); a CUDA graph replays the kernels without either, but needs
the same shapes and the same memory at every replay. So here:
- shapes come in buckets (`bucket`, powers of two): the prompt is left-padded to its bucket, the
  rows to theirs (copies of the last row, thrown away), the new-token columns to theirs, so rounds
  whose shapes differ a little reuse one cache and one graph; a call runs in a larger bucket a
  model holds already where that costs at most `MAX_WASTE` times its own (`ModelBuffers.state`), so
  the turns of multi-turn episodes (fewer rows, longer prompts, less budget at each turn) share
  graphs instead of capturing one per turn, round after round, once more than `MAX_STATES`
  buckets take turns (not timed on a GPU: the captures were counted on the CPU's stand-in);
- the cache and every input and output of the step live in the buffers of a `DecodeState`,
  allocated once per model and bucket (the decoder keeps the cache in the weights' dtype on a GPU,
  float32 on a CPU);
- the step (`step`) samples inside, with the loop's logits processors (those that read the
  sequence's length or last tokens in their fixed-shape forms, `fixed_processors`) and its
  inverse-CDF sampling on uniforms drawn up front, records its token and log-prob, and advances a
  step counter held on the device; rows that finished stay in the batch and record padding;
- the weights a step reads keep their memory: q/k/v and gate/up are joined into buffers rewritten
  in place when the weights change (`JoinedWeights`), the rest are read where they lie, and a graph
  is captured again when any weight it reads has moved (`graph_for`);
- the host asks whether every row is done once every `CHECK_EVERY` steps (steps after the last
  row's end only record padding).
On CUDA the step is captured once per bucket and sampling settings (`capture`) and replayed;
elsewhere the same step runs eagerly. `decoding.StaticLlamaDecoder` is the Llama step on these
buffers, `model_forward.StaticForwardDecoder` the model's own forward on a `StaticCache`, and
`decoding.decoder_for` the one place that picks one; either step may go through `torch.compile`
before it is captured (`compile_step`). Their tokens are the shrinking loop's for the
same seed (tests/test_fixed_shape.py, tests/test_model_forward.py).
"""

import functools
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList

from grpo_hf.engine import fixed_processors
from grpo_hf.engine.cpu import BlockedWeights, weights_stamp

logger = logging.getLogger(__name__)

MIN_COLUMNS = 16  # the smallest bucket of prompt or new-token columns
CHECK_EVERY = 16  # steps between the host's checks that every row is done
MAX_STATES = 3  # buckets whose cache and graphs a model keeps; the least recently used goes
MAX_WASTE = 4  # a call runs in a held bucket of at most this many times its own bucket's cells
WARMUP_STEPS = 3  # eager steps on the capture stream before capturing (as PyTorch's CUDA graph notes)


def bucket(n: int, least: int = MIN_COLUMNS) -> int:
    """The smallest power of two >= n, and >= `least`."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def sampling_key(config: GenerationConfig) -> str:
    """What a captured step bakes in besides shapes: every generation setting but the length."""
    settings = {k: v for k, v in config.to_dict().items() if k != "max_new_tokens"}
    return repr(sorted(settings.items()))


def graphs_enabled(device: torch.device) -> bool:
    """Whether steps on `device` are captured as CUDA graphs (else they run eagerly)."""
    return device.type == "cuda"


class CaptureFailed(RuntimeError):
    """Capturing a decoding step as a CUDA graph failed; the message names the setting that avoids it."""


class JoinedWeights:
    """Groups of weights as one matrix each, at a fixed address (a graph reads its weights where it
    was captured). A group of one is its weight itself; a joined group is rewritten in place when
    one of its weights changed (`cpu.weights_stamp`), every time for weights that require grad (an
    optimizer may write them without bumping their version counters)."""

    def __init__(self):
        self.entries: dict[tuple[int, ...], tuple] = {}  # ids -> (weights, stamp, joined)

    def join(self, groups: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """cat(group) for each group; entries of groups not asked for are dropped."""
        entries, joined = {}, []
        for weights in groups:
            if len(weights) == 1:
                joined.append(weights[0])
                continue
            key, stamp = tuple(id(w) for w in weights), weights_stamp(weights)
            cached = self.entries.get(key)
            if cached is None:
                cached = (weights, stamp, torch.cat(weights))
            elif cached[1] != stamp or any(w.requires_grad for w in weights):
                cached = (weights, stamp, torch.cat(weights, out=cached[2]))
            entries[key] = cached
            joined.append(cached[2])
        self.entries = entries
        return joined


class DecodeState:
    """The buffers of one bucket: (rows, prompt_width, new_tokens) and a `vocab`-wide head.

    `own(decoder)` holds a kind of decoder's own buffers (its cache, attention bias, positions);
    `graphs` the captured steps, by decoder, compiled or not, and sampling settings.
    """

    def __init__(self, rows: int, prompt_width: int, new_tokens: int, vocab: int, device: torch.device):
        self.rows, self.prompt_width, self.new_tokens = rows, prompt_width, new_tokens
        long = {"dtype": torch.long, "device": device}
        self.t = torch.zeros(1, **long)  # (1,) the step, on the device
        self.prompt_start = torch.zeros(1, **long)  # (1,) the call's first prompt column (W - P)
        self.columns = torch.arange(prompt_width + new_tokens, **long)  # (W,)
        self.sequence = torch.zeros(rows, prompt_width + new_tokens, **long)  # (R, W) for the processors
        self.logits = torch.zeros(rows, vocab, device=device)  # (R, V) float32
        self.uniforms = torch.zeros(new_tokens, rows, 1, dtype=torch.float64, device=device)  # (N, R, 1)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)  # (R,)
        self.lengths = torch.zeros(rows, **long)  # (R,) tokens recorded
        self.tokens = torch.zeros(rows, new_tokens, **long)  # (R, N)
        self.logps = torch.zeros(rows, new_tokens, device=device)  # (R, N) float32
        self.decoders: dict[str, dict[str, object]] = {}  # kind of decoder -> its buffers
        self.graphs: dict[tuple, tuple] = {}  # (kind, compiled, sampling key) -> (replay, pointers, kept)
        self.capture_seconds: float | None = None  # the last capture's

    def own(self, decoder) -> dict[str, object]:
        """The buffers of `decoder`'s kind in this bucket (kinds keep their caches apart)."""
        return self.decoders.setdefault(type(decoder).__name__, {})

    def held(self, decoder, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value` copied into this bucket's buffer `name` of `decoder`'s kind (made on first use):
        the tensor a captured step reads, at the same address call after call."""
        buffers = self.own(decoder)
        if name not in buffers:
            buffers[name] = torch.empty_like(value)
        return buffers[name].copy_(value)

    def where(self) -> fixed_processors.Where:
        """The step and the prompt's first column, as the fixed-shape processors read them."""
        return fixed_processors.Where(self.t, self.prompt_start, self.prompt_width)

    def begin(
        self,
        prompt_ids: torch.Tensor,
        logits: torch.Tensor,
        uniforms: torch.Tensor | None,
        pad: int,
    ) -> None:
        """A call's start: its (B, P) prompts (the processors' sequence), (R, V) first logits and
        (N, B, 1) uniforms (None: greedy); the bucket's rows past B count as finished."""
        rows, prompt_columns = prompt_ids.shape
        self.t.zero_()
        self.prompt_start.fill_(self.prompt_width - prompt_columns)
        sequence = processor_sequence(prompt_ids, self.rows, self.prompt_width, self.new_tokens)
        self.sequence.copy_(sequence)
        self.logits.copy_(logits)
        self.uniforms.zero_()
        if uniforms is not None:
            self.uniforms[: uniforms.shape[0], :rows] = uniforms
        self.finished.copy_(torch.arange(self.rows, device=self.t.device) >= rows)  # (R,)
        self.lengths.zero_()
        self.tokens.fill_(pad)
        self.logps.zero_()


class ModelBuffers:
    """What a model keeps between calls: its joined weights (with rollout_quantization='fp8' each
    group's FP8 form instead, updated in place), its recent buckets' states, and whether a capture
    of its step failed (`give_up`)."""

    def __init__(self):
        self.joins = JoinedWeights()
        self.quantized = BlockedWeights()
        self.states: OrderedDict[tuple[int, int, int], DecodeState] = OrderedDict()
        self.capture_failed = False

    def state(self, prompt_ids: torch.Tensor, new_tokens: int, vocab: int) -> DecodeState:
        """Where (B, P) prompts and `new_tokens` columns decode: the smallest held bucket that `fits`
        their own (a step's cost on a GPU grows with its cells far less than a capture costs), else
        their own, made on first use."""
        rows, prompt_width = prompt_ids.shape
        shape = (bucket(rows, least=1), bucket(prompt_width), bucket(new_tokens))
        fitting = [held for held in self.states if fits(shape, held)]
        if fitting:
            shape = min(fitting, key=cells)
            self.states.move_to_end(shape)
            return self.states[shape]
        while len(self.states) >= MAX_STATES:  # free the oldest before allocating
            self.states.popitem(last=False)
        self.states[shape] = DecodeState(*shape, vocab, prompt_ids.device)
        return self.states[shape]


def cells(shape: tuple[int, int, int]) -> int:
    """A bucket's (rows, prompt columns, new-token columns) cache cells: rows x columns."""
    rows, prompt_width, new_tokens = shape
    return rows * (prompt_width + new_tokens)


def fits(shape: tuple[int, int, int], held: tuple[int, int, int]) -> bool:
    """Whether a call of bucket `shape` may run in the bucket `held`: as large in every dimension,
    and at most MAX_WASTE times the cells."""
    return all(h >= n for h, n in zip(held, shape, strict=True)) and cells(held) <= MAX_WASTE * cells(shape)


_BUFFERS: "weakref.WeakKeyDictionary[nn.Module, ModelBuffers]" = weakref.WeakKeyDictionary()


def buffers_of(model: nn.Module) -> ModelBuffers:
    """`model`'s `ModelBuffers`, kept as long as the model lives."""
    return _BUFFERS.setdefault(model, ModelBuffers())


def give_up(model: nn.Module, error: CaptureFailed) -> None:
    """After a failed capture under generation_backend='auto': `model`'s buckets freed, and auto
    decodes it with rows leaving as they end from then on (`capture_failed`), saying so once."""
    buffers = buffers_of(model)
    buffers.capture_failed = True
    buffers.states.clear()
    logger.warning(
        "%s generation_backend='auto' goes on decoding this model with rows leaving the batch as they end.",
        error,
    )


def padded(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: int, width: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) left-padded prompts as (rows, width): more padding on the left, copies of the last row below."""
    extra_rows, extra_columns = rows - prompt_ids.shape[0], width - prompt_ids.shape[1]
    ids = F.pad(prompt_ids, (extra_columns, 0), value=pad)  # (B, width)
    mask = F.pad(prompt_mask, (extra_columns, 0), value=0)  # (B, width)
    return (
        torch.cat([ids, ids[-1:].expand(extra_rows, -1)]),
        torch.cat([mask, mask[-1:].expand(extra_rows, -1)]),
    )  # (rows, width) each


def processor_sequence(prompt_ids: torch.Tensor, rows: int, width: int, new_tokens: int) -> torch.Tensor:
    """(rows, width + new_tokens): what the processors see, each row's (B, P) prompt at its place.

    The shrinking loop hands them the prompt and the tokens drawn so far. Here the columns outside
    those (bucket padding, tokens not drawn yet) repeat the row's last prompt column, a token the
    sequence holds already, and the fixed-shape processors read only which tokens it holds.
    """
    batch, prompt_width = prompt_ids.shape
    last = prompt_ids[:, -1:]  # (B, 1)
    sequence = torch.cat(
        [last.expand(batch, width - prompt_width), prompt_ids, last.expand(batch, new_tokens)], dim=1
    )  # (B, width + new_tokens)
    return torch.cat([sequence, sequence[-1:].expand(rows - batch, -1)])


def step(
    state: DecodeState,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    choose: Callable,
    eos: torch.Tensor,
    pad: int,
    sampling: bool,
) -> None:
    """One decoding step on the state's buffers, with no host synchronisation: each row's token
    from the current logits (`choose`: processors, then sampling), recorded (padding and log-prob 0
    for rows already finished), then fed through `forward(token, t)` for the next logits."""
    t, finished = state.t, state.finished  # (1,), (R,)
    uniforms = state.uniforms.index_select(0, t).squeeze(0) if sampling else None  # (R, 1)
    token, logp = choose(state.sequence, state.logits, uniforms)  # (R,) each
    state.tokens.index_copy_(1, t, torch.where(finished, pad, token).unsqueeze(1))
    state.logps.index_copy_(1, t, logp.masked_fill(finished, 0.0).unsqueeze(1))
    state.lengths.add_((~finished).long())
    finished.logical_or_((token.unsqueeze(1) == eos).any(dim=1))  # not isin: with many ids it syncs
    state.sequence.index_copy_(1, t + state.prompt_width, token.unsqueeze(1))
    state.logits.copy_(forward(token, t))
    t.add_(1)


def capture(run_step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """`run_step` as a CUDA graph: a few eager steps on a side stream, then captured on the same
    stream (PyTorch's CUDA graph notes); returns its replay. Only this thread's CUDA calls are
    checked during the capture ('thread_local'): a helper thread of the run (a reward model, a data
    loader) may use the GPU meanwhile without being captured."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_STEPS):
            run_step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        run_step()
    return graph.replay


def graph_for(
    state: DecodeState,
    key: tuple,
    pointers: tuple[int, ...],
    run_step: Callable[[], None],
    keep: tuple,
    fallback: str,
) -> tuple[Callable[[], None], bool]:
    """The replay of the step for `key` (decoder, compiled or not, sampling settings), and whether
    it was captured just now (capturing runs steps on the state). Captured again when a weight it
    reads moved (`pointers`); `keep`: what the step reads that nothing else holds (tensors, the
    processors' masks); `fallback`: the setting a failed capture's error names."""
    cached = state.graphs.pop(key, None)  # a stale graph's memory goes before capturing anew
    if cached is not None and cached[1] == pointers:
        state.graphs[key] = cached
        return cached[0], False
    start = time.perf_counter()
    try:
        replay = capture(run_step, state.t.device)
    except RuntimeError as error:
        raise CaptureFailed(
            f"Capturing the decoding step as a CUDA graph failed ({error}); {fallback}."
        ) from error
    state.capture_seconds = time.perf_counter() - start
    state.graphs[key] = (replay, pointers, keep)
    logger.info(
        "Captured the decoding step as a CUDA graph (%d rows, %d prompt columns, %d new-token columns) "
        "in %.2f s.",
        state.rows,
        state.prompt_width,
        state.new_tokens,
        state.capture_seconds,
    )
    return replay, True


def run(
    state: DecodeState,
    replay: Callable[[], None],
    max_new_tokens: int,
    rows: int,
    all_done: Callable[[bool], bool] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step until every row is done (asked every CHECK_EVERY steps; with `all_done`, every process)
    or `max_new_tokens`; the first `rows` rows' (rows, C) tokens and log-probs, C the longest
    completion, as views of the state's buffers."""
    for done_steps in range(0, max_new_tokens, CHECK_EVERY):
        for _ in range(min(CHECK_EVERY, max_new_tokens - done_steps)):
            replay()
        done = bool(state.finished.all())
        if all_done(done) if all_done is not None else done:
            break
    width = int(state.lengths[:rows].max())
    return state.tokens[:rows, :width], state.logps[:rows, :width]  # (B, C) each


def compile_step(eager_forward: Callable, backend: str | Callable = "inductor") -> Callable:
    """A decoder's `eager_forward` through `torch.compile`: the step's small kernels (RMSNorm,
    RoPE, the cache writes, the MLP's activations: ~35 per layer in Llama) become a few fused ones,
    which is what a CUDA-graph step of a small model is made of. It compiles at a bucket's first
    step (before the capture; tens of seconds) and the graph then replays the fused kernels. The
    decoder's tensors (weights, cache, buffers) are inputs of the compiled code, not constants: new
    weights and caches reach it without compiling again. Shapes: the first bucket's are static; at
    a second bucket dynamo compiles once more with the dimensions that changed (rows, cache columns)
    symbolic (its automatic dynamic shapes), and later buckets reuse that code: two compilations in
    a run, not one per bucket (past dynamo's recompile limit, 8, a step would run uncompiled)."""
    return torch.compile(eager_forward, backend=backend, dynamic=None)


@functools.cache
def compiled_step(eager_forward: Callable) -> Callable:
    """`compile_step` with inductor, made once per process and kind of decoder."""
    return compile_step(eager_forward)


def decode(
    decoder,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: GenerationConfig,
    processors: LogitsProcessorList,
    choose: Callable,
    uniforms: torch.Tensor | None,
    all_done: Callable[[bool], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) prompts decoded by a fixed-shape `decoder` in the buffers of their bucket; (B, C) new
    tokens and their log-probs, as the shrinking loop returns them.

    The decoder gives `model`, `max_new_tokens` (a bucket), `vocab`, `compiled` (its step through
    `compiled_step`), `CAPTURE_FALLBACK` (what to set when capturing fails), `prefill(ids, mask,
    state)`, `eager_forward(token, t)` and `weight_pointers()`. `processors` are the loop's
    (`fixed_processors.for_fixed_shapes` makes their fixed-shape forms), `choose(processors,
    sequence, logits, uniforms)` its sampling; `uniforms` (N, B, 1) its numbers (None: greedy).
    Autocast is off, as in the shrinking loop's decoding (a graph must not read autocast's cached
    weight casts, which go with the autocast region).
    """
    state = buffers_of(decoder.model).state(prompt_ids, decoder.max_new_tokens, decoder.vocab)
    decoder.max_new_tokens = state.new_tokens  # a larger bucket held already: its columns
    with torch.inference_mode(), torch.autocast(prompt_ids.device.type, enabled=False):
        processors = fixed_processors.for_fixed_shapes(
            processors, state.where(), decoder.vocab, prompt_ids.device
        )
        choose = functools.partial(choose, processors)
        tokens, logps = _decode(decoder, state, prompt_ids, prompt_mask, config, choose, uniforms, all_done)
    return tokens.clone(), logps.clone()  # outside inference mode: plain tensors


def _decode(decoder, state, prompt_ids, prompt_mask, config, choose, uniforms, all_done):
    rows, pad = prompt_ids.shape[0], config.pad_token_id
    ids, mask = padded(prompt_ids, prompt_mask, state.rows, state.prompt_width, pad)
    logits = decoder.prefill(ids, mask, state)  # (R, V)
    eos_ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    eos = torch.tensor(eos_ids, device=ids.device)

    def begin() -> None:
        state.begin(prompt_ids, logits, uniforms, pad)

    forward = decoder.eager_forward
    if decoder.compiled:
        forward = functools.partial(compiled_step(type(decoder).eager_forward), decoder)

    def run_step() -> None:
        step(state, forward, choose, eos, pad, uniforms is not None)

    begin()
    replay = run_step
    if graphs_enabled(ids.device):
        # the decoder's kind, compiled or not: the steps' kernels differ
        key = (type(decoder).__name__, decoder.compiled, sampling_key(config))
        pointers = decoder.weight_pointers()
        replay, captured = graph_for(state, key, pointers, run_step, (eos, choose), decoder.CAPTURE_FALLBACK)
        if captured:
            begin()  # warming the capture up ran steps on the state
    return run(state, replay, config.max_new_tokens, rows, all_done)
