"""GPU generation without vLLM, ours against TRL, with transformers' static-cache generate as the
reference line (issue 30): tokens/s, s/step and peak memory.

    python bench/gpu_decode.py --model-config .gpu-assets/smollm2-config   # a GPU machine, no hub
    make bench-gpu                                                           # the same, TRL installed first
    python bench/gpu_decode.py --workloads smol-8x8-256 --prompts 1 --num-generations 2 \\
        --max-completion-length 4 --steps 2 --reference-rows 2 --reference-tokens 4   # a CPU smoke run

The models have SmolLM2-135M's config (`--model-config`: a folder with its config.json and
tokenizer; default the embedded SmolLM2-135M-Instruct's) with random weights, as
../shared/gpu/make_models.py builds them: 'smol' as it is, 'llama1b' with Llama-3.2-1B's body.
Random weights almost never sample EOS, so completions run to the limit. The workloads are the
issue's table: G = 8, LoRA r=16 on q/k/v/o (full fine-tuning for 'full'), bf16 where the GPU has
it, float32 elsewhere; all of a step's completions in one micro-batch and gradient checkpointing
off on both sides (TRL's default turns it on: `--gradient-checkpointing` turns it on for both).
Each (workload, side) trains `--steps` optimizer steps in a subprocess of its own, with
`bench/worker.py`'s trainer and arithmetic prompts: s/step is the median over the steps after the
first; tokens/s ours' logged generation/tokens_per_second, TRL's completion tokens over
its own generate timer; peak memory the last step's `torch.cuda.max_memory_allocated` (on a CPU
the worker's peak RSS). The reference process generates `--reference-rows` x `--reference-tokens`
from the smol model with transformers' `generate` on a static cache (compiled on CUDA) and with our
decoders (generation_backend 'llama_static', 'llama' and 'transformers_static', the fixed-shape path
of models other than Llama, through the model's own forward; on CUDA 'llama_compiled' and
'transformers_compiled' too, compiled as theirs is), and the fixed-shape Llama decoders again on
the model's FP8 form (`rollout_quantization='fp8'`: `_fp8` lines; emulated on a CPU, where they
say nothing of speed): each line's tokens/s is its second call's;
its first call's seconds (compilation, or the CUDA graph capture) are printed beside.
TRL is needed only for its side (`pip install -e ".[bench]"`); without it that side is skipped and
the output says so. Results: bench/results/<date>-gpu_decode-<machine>.json.
"""

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import LastStepPeak  # noqa: E402
from results_file import results_path  # noqa: E402
from run import rerun_command, run_worker  # noqa: E402
from worker import StepTimer, build_trainer, per_step_logs, tokens_per_second  # noqa: E402

from grpo_hf.data import rollout  # noqa: E402
from grpo_hf.engine.generation import Sampling  # noqa: E402
from grpo_hf.engine.local import generate, generation_config  # noqa: E402
from grpo_hf.engine.quantization import quantize_linears  # noqa: E402
from grpo_hf.models.loading import DEFAULT_MODEL, resolve_model_path  # noqa: E402
from grpo_hf.tasks import arithmetic_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # ../shared/gpu/make_models.py's
    "smol": {},
    "llama1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
}  # fmt: skip
WORKLOADS = {  # name: (shape, prompts per step, G, max completion length, LoRA)
    "smol-8x8-256": ("smol", 8, 8, 256, True),
    "llama1b-4x8-256": ("llama1b", 4, 8, 256, True),
    "smol-4x8-1024": ("smol", 4, 8, 1024, True),
    "smol-4x8-2048": ("smol", 4, 8, 2048, True),
    "smol-full-8x8-256": ("smol", 8, 8, 256, False),
}
REFERENCE_BACKENDS = ("llama_static", "llama", "transformers_static")
COMPILED_BACKENDS = ("llama_compiled", "transformers_compiled")  # on CUDA, where theirs compiles too
FP8_BACKENDS = ("llama_static",)  # and llama_compiled on CUDA: the decoders of FP8 rollouts on a GPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-config", default=None, help="Folder with SmolLM2-135M's config.json and tokenizer."
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"Comma-separated from {list(WORKLOADS)}."
    )
    parser.add_argument("--sides", default="ours,trl", help="Comma-separated: ours, trl.")
    parser.add_argument(
        "--steps", type=int, default=3, help="Optimizer steps per run; the first is not timed."
    )
    parser.add_argument("--prompts", type=int, default=None, help="Prompts per step, every workload.")
    parser.add_argument("--num-generations", type=int, default=None, help="G, every workload.")
    parser.add_argument("--max-completion-length", type=int, default=None, help="Every workload.")
    parser.add_argument(
        "--generation-backend",
        default="auto",
        help="Ours: GRPOConfig.generation_backend ('auto': on a GPU the compiled fixed-shape decoder).",
    )
    parser.add_argument(
        "--rollout-quantization",
        default=None,
        help="Ours: GRPOConfig.rollout_quantization ('fp8': the sampler on FP8 matmuls, compute capability 8.9+).",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="Both sides train with gradient checkpointing (TRL's default; off by default here).",
    )
    parser.add_argument("--reference-rows", type=int, default=64)
    parser.add_argument("--reference-tokens", type=int, default=256)
    parser.add_argument("--no-reference", action="store_true", help="Skip the reference generate lines.")
    parser.add_argument("--timeout", type=float, default=3600, help="Seconds before a worker is stopped.")
    parser.add_argument("--output", default=str(results_path("gpu_decode")))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one run's JSON spec
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := [w for w in args.workloads if w not in WORKLOADS] + [
        s for s in args.sides if s not in ("ours", "trl")
    ]:
        parser.error(f"unknown workload or side {unknown}; workloads: {list(WORKLOADS)}, sides: ours, trl.")
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is a warm-up and is not timed.")
    return args


def random_model(config_dir: str, shape: str) -> torch.nn.Module:
    """The config's model in `shape` with random weights (seed 0), float32."""
    config = AutoConfig.from_pretrained(config_dir)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    config.max_position_embeddings = max(config.max_position_embeddings, 8192)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def precision() -> str:
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def train(spec: dict) -> dict:
    """One side's GRPO steps on one workload."""
    shape, prompts, generations, length, lora = spec["workload"]
    settings = argparse.Namespace(  # the fields `worker.training_settings` reads
        num_generations=generations, prompts_per_step=prompts, max_completion_length=length, beta=0.04,
        learning_rate=1e-4, steps=spec["steps"], seed=0, precision=precision(), side=spec["side"], vllm=False,
    )  # fmt: skip
    overrides = {"gradient_checkpointing": spec["gradient_checkpointing"]}
    if spec["side"] == "ours":
        overrides["generation_backend"] = spec["generation_backend"]
        overrides["rollout_quantization"] = spec["rollout_quantization"]
    tokenizer = AutoTokenizer.from_pretrained(spec["config"])
    with tempfile.TemporaryDirectory(prefix=f"gpu-decode-{spec['side']}-") as output_dir:
        model = random_model(spec["config"], shape)
        if spec["side"] == "trl" and not lora:  # TRL loads its reference model from the policy's path
            model.save_pretrained(Path(output_dir) / "policy")
            model.config._name_or_path = str(Path(output_dir) / "policy")
        trainer, generate_seconds = build_trainer(
            settings, output_dir, model=model, lora=lora, tokenizer=tokenizer, **overrides
        )
        peak, timer = LastStepPeak(), StepTimer()
        trainer.add_callback(peak)
        trainer.add_callback(timer)  # last: the other callbacks' step work is inside the window
        trainer.train()
    logs = per_step_logs(trainer.state.log_history)
    tps, method = tokens_per_second(
        spec["side"], logs, timer.seconds, generate_seconds, prompts * generations
    )
    return {
        "side": spec["side"],
        "precision": settings.precision,
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
        "step_seconds": timer.seconds,
        "median_step_seconds": statistics.median(timer.seconds[1:]),
        "median_tokens_per_second": statistics.median(tps[1:]),
        "tokens_per_second_method": method,
        "mean_completion_length": statistics.mean(e["completions/mean_length"] for e in logs),
        "peak_gib": None if peak.peak_bytes is None else peak.peak_bytes / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
    }


def timed(call, eos: list[int]) -> dict:
    """Two calls of `call` (returning (rows, new) token ids): the second's tokens/s, the first's seconds."""
    seconds = []
    for _ in range(2):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        new_tokens = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    tokens = int(rollout.completion_mask_after_eos(new_tokens, eos)[0].sum())  # up to each row's EOS
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"first_call_seconds": seconds[0], "seconds": seconds[1], "tokens": tokens,
            "tokens_per_second": tokens / seconds[1], "peak_gib": peak}  # fmt: skip


def reference(spec: dict) -> dict:
    """transformers' static-cache generate and our decoders on the same rows of the smol model."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if precision() == "bf16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(spec["config"])
    model = random_model(spec["config"], "smol").to(device, dtype).eval().requires_grad_(False)
    rows, new = spec["rows"], spec["tokens"]
    questions = arithmetic_dataset(num_train=max(1, rows // 8), num_test=1)["train"]["prompt"]
    texts = [rollout.render_prompt(tokenizer, questions[i * len(questions) // rows]) for i in range(rows)]
    ids, mask = rollout.tokenize_prompts(tokenizer, texts, None, torch.device(device))  # (rows, P), G copies
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    pad = eos[0] if pad is None else pad
    sampling = Sampling(new, 1.0, 0, 1.0, None, 1.0, eos, pad)
    ours, theirs = generation_config(sampling), generation_config(sampling)
    theirs.cache_implementation, theirs.disable_compile = "static", device != "cuda"  # compiled on CUDA
    width = ids.shape[1]
    lines = {
        "transformers_static": timed(
            lambda: model.generate(input_ids=ids, attention_mask=mask, generation_config=theirs)[:, width:],
            eos,
        )
    }
    for backend in REFERENCE_BACKENDS + (COMPILED_BACKENDS if device == "cuda" else ()):  # as theirs
        lines[f"ours_{backend}"] = timed(
            lambda b=backend: generate(model, ids, mask, ours, b).completion_ids, eos
        )
    fp8 = quantize_linears(copy.deepcopy(model), "fp8")  # rollout_quantization='fp8' (emulated on a CPU)
    for backend in FP8_BACKENDS + (("llama_compiled",) if device == "cuda" else ()):
        lines[f"ours_{backend}_fp8"] = timed(
            lambda b=backend: generate(fp8, ids, mask, ours, b).completion_ids, eos
        )
    return {"rows": rows, "new_tokens": new, "dtype": str(dtype), "lines": lines}


def versions() -> dict:
    found = {}
    for package in ("torch", "transformers", "trl", "peft"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def worker_command(spec: dict) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]


def workload(args: argparse.Namespace, name: str) -> list:
    """A workload's (shape, prompts, G, length, LoRA) with the command line's overrides."""
    shape, prompts, generations, length, lora = WORKLOADS[name]
    return [shape, args.prompts or prompts, args.num_generations or generations,
            args.max_completion_length or length, lora]  # fmt: skip


def print_report(report: dict) -> None:
    print(f"\nDevice: {report['device']}; versions {report['versions']}")
    for side in report["skipped"]:
        print(f"{side}: skipped, not installed (pip install -e '.[bench]', or make bench-gpu)")
    print(f"{'workload':<20} {'ours s/step':>11} {'TRL s/step':>10} {'TRL/ours':>8} {'ours tok/s':>10} "
          f"{'TRL tok/s':>9} {'peak GiB ours / TRL':>19}")  # fmt: skip
    if report["device"] == "cpu":
        print("(no GPU: peak is each worker's RSS)")
    print(f"gradient checkpointing: {'on' if report['gradient_checkpointing'] else 'off'} (both sides)")
    for name, sides in report["workloads"].items():
        ours, trl = sides.get("ours", {}), sides.get("trl", {})
        ratio = (
            trl["median_step_seconds"] / ours["median_step_seconds"]
            if "median_step_seconds" in ours and "median_step_seconds" in trl
            else None
        )
        peak = " / ".join(_number(s.get("peak_gib") or s.get("peak_rss_gib"), 2) for s in (ours, trl))
        print(f"{name:<20} {_number(ours.get('median_step_seconds'), 2):>11} {_number(trl.get('median_step_seconds'), 2):>10} "
              f"{_number(ratio, 2):>8} {_number(ours.get('median_tokens_per_second'), 0):>10} "
              f"{_number(trl.get('median_tokens_per_second'), 0):>9} {peak:>19}")  # fmt: skip
        for side, result in sides.items():
            if "error" in result:
                print(f"  {side} FAILED ({result['error']}); log: {result['log']}")
    if "rows" in report.get("reference", {}):
        ref = report["reference"]
        print(f"Reference: {ref['rows']} rows x {ref['new_tokens']} new tokens, smol model, {ref['dtype']}:")
        for name, line in ref["lines"].items():
            print(f"  {name:<25} {line['tokens_per_second']:>9.0f} tok/s  (first call {line['first_call_seconds']:.2f} s, "
                  f"then {line['seconds']:.2f} s; peak {_number(line['peak_gib'], 2)} GiB)")  # fmt: skip
    elif "error" in report.get("reference", {}):
        print(f"Reference FAILED ({report['reference']['error']}); log: {report['reference']['log']}")
    print("Rerun: " + report["command"])


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        result = train(spec) if spec["kind"] == "train" else reference(spec)
        Path(spec["output"]).write_text(json.dumps({**result, "device": device_name()}, indent=1))
        return None
    output = Path(args.output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    config = args.model_config or resolve_model_path(DEFAULT_MODEL)
    skipped = ["trl"] if "trl" in args.sides and importlib.util.find_spec("trl") is None else []
    if skipped:
        print("TRL is not installed: its side is skipped (pip install -e '.[bench]', or make bench-gpu).")
    report = {"command": rerun_command(), "device": device_name(), "versions": versions(), "skipped": skipped,
              "gradient_checkpointing": args.gradient_checkpointing,
              "rollout_quantization": args.rollout_quantization, "workloads": {}, "reference": {}}  # fmt: skip
    runs = [(name, side) for name in args.workloads for side in args.sides if side not in skipped]
    for name, side in runs:
        result_path = output.parent / f"gpu_decode.{name}.{side}.json"
        spec = {"kind": "train", "workload": workload(args, name), "side": side, "steps": args.steps,
                "config": str(config), "generation_backend": args.generation_backend, "output": str(result_path),
                "gradient_checkpointing": args.gradient_checkpointing,
                "rollout_quantization": args.rollout_quantization}  # fmt: skip
        print(f"[bench-gpu] {name}, {side} ...", flush=True)
        log = output.parent / f"gpu_decode.{name}.{side}.log"
        report["workloads"].setdefault(name, {})[side] = run_worker(
            worker_command(spec), log, result_path, args.timeout
        )
    if not args.no_reference:
        result_path = output.parent / "gpu_decode.reference.json"
        spec = {"kind": "reference", "rows": args.reference_rows, "tokens": args.reference_tokens,
                "config": str(config), "output": str(result_path)}  # fmt: skip
        print("[bench-gpu] reference generate lines ...", flush=True)
        log = output.parent / "gpu_decode.reference.log"
        report["reference"] = run_worker(worker_command(spec), log, result_path, args.timeout)
    output.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"Results: {output}")
    return report


if __name__ == "__main__":
    main()
