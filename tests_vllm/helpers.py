"""What the colocate and server tests share: a SmolLM2 + LoRA trainer, prompts, our decoder's greedy
completions, weights perturbed in place, and the checks of items a (log-probs) and b (sync)."""

import dataclasses
import math

import torch
from peft import LoraConfig
from vllm_server_process import model_path

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.algorithm.sampler_correction import Truncation
from grpo_hf.data import rollout
from grpo_hf.engine import local
from grpo_hf.engine.generation_copy import GenerationCopy
from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.models.loading import load_model
from grpo_hf.tasks import arithmetic_dataset
from grpo_hf.training.checkpoints import STATE_FILE

DATASET = arithmetic_dataset(num_train=32, num_test=4)["train"]
# The tool tests force the first turn to be a call (vllm_structured_outputs_regex): a 135M model
# rarely calls a tool of its own accord.
TOOL_CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")


def length_reward(completions, **kwargs) -> list[float]:
    return [len(c[0]["content"]) / 10 for c in completions]


# How far the sampler's log-probs may be from our log-prob pass, per token, at each precision of the
# trainer (the engine's or server's own dtype aside). float32 on both sides: the same numbers up to
# summation order. bf16: `bench/precision_gap.py` measured up to 0.56 between a bf16 engine and our
# bf16-autocast pass over 32 completions of ~150 tokens, mean 0.04 (docs/benchmarks.md, make bench-precision); 0.75 leaves room
# for other CPUs' kernels. The mean ratio pi_old / pi_sampler stays within 5% of 1 at either.
SAMPLER_GAP = {False: 1e-3, True: 0.75}
RATIO_MEAN_GAP = {False: 1e-3, True: 0.05}


def make_trainer(tmp_path, peft: bool = True, tools=None, **settings) -> GRPOTrainer:
    """A SmolLM2 trainer in float32 (precision='auto' for the tests that run at the machine's)."""
    args = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
        max_steps=1, learning_rate=1e-3, beta=0.0, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        disable_tqdm=True, logging_steps=1, precision="fp32",
    ) | settings  # fmt: skip
    return GRPOTrainer(
        model=model_path(),
        reward_funcs=length_reward,
        args=GRPOConfig(**args),
        train_dataset=DATASET,
        peft_config=LORA if peft else None,
        tools=tools,
    )


def prompts(trainer: GRPOTrainer, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [rollout.render_prompt(trainer.processing_class, DATASET[i]["prompt"]) for i in rows]
    return rollout.tokenize_prompts(trainer.processing_class, texts, None, torch.device("cpu"))


def completions(result: rollout.Rollout) -> list[list[int]]:
    return [
        ids[mask.bool()].tolist()
        for ids, mask in zip(result.completion_ids, result.completion_mask, strict=True)
    ]


def vllm_greedy(trainer: GRPOTrainer, ids, mask, version: int) -> list[list[int]]:
    """vLLM's greedy completions after the weights of policy `version` were sent."""
    greedy = dataclasses.replace(trainer.sampling, generation_kwargs={"temperature": 0.0})
    return completions(trainer.generator.generate(ids, mask, greedy, policy_version=version))


def our_greedy(trainer: GRPOTrainer, model, ids, mask) -> list[list[int]]:
    """Our decoder's greedy completions of `model` (LoRA merged into a float32 copy)."""
    plain = GenerationCopy(model, torch.float32).refresh()
    config = local.generation_config(
        dataclasses.replace(trainer.sampling, generation_kwargs={"do_sample": False})
    )
    return completions(local.generate(plain, ids, mask, config))


@torch.no_grad()
def perturb(
    model: torch.nn.Module, names: tuple[str, ...], scale: float, seed: int
) -> dict[str, torch.Tensor]:
    """Add noise to the parameters whose name contains one of `names`; return the originals."""
    generator = torch.Generator().manual_seed(seed)
    saved = {}
    for name, param in model.named_parameters():
        if any(part in name for part in names):
            saved[name] = param.detach().clone()
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    assert saved, names
    return saved


@torch.no_grad()
def restore(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        if name in saved:
            param.copy_(saved[name])


def assert_sampler_logps_match(trainer: GRPOTrainer, temperature: float, version: int) -> None:
    """Item a: the sampler's log-probs of vLLM's completions equal our log-prob pass of the same
    tokens at the same temperature, within 1e-3 on every completion token."""
    ids, mask = prompts(trainer, [0, 0, 1, 1, 2, 2])
    sampling = dataclasses.replace(trainer.sampling, temperature=temperature)
    result = trainer.generator.generate(ids, mask, sampling, policy_version=version)
    ours, _, _ = completion_logps(
        trainer.model, result.input_ids, result.attention_mask, result.completion_ids.shape[1], temperature
    )  # (B, C)
    active = result.completion_mask.bool()
    assert active.sum() >= 12
    gap = (result.sampler_logps - ours.detach()).abs()[active]
    assert gap.max() < 1e-3, f"max |vLLM - ours| = {gap.max():.2e} at T = {temperature}"
    assert torch.all(result.sampler_logps[~active] == 0)


def assert_top_k_sampler_logps_are_renormalised(trainer: GRPOTrainer, top_k: int, version: int) -> None:
    """Under top_k, vLLM's processed_logprobs are those of the distribution it sampled: our pass's
    full-vocabulary log-prob of each drawn token minus the log of the probability its position's k
    likeliest tokens hold, log(p / kept mass), within 1e-3, as our decoder records them (test_rollout)."""
    ids, mask = prompts(trainer, [0, 0, 1, 1, 2, 2])
    sampling = dataclasses.replace(trainer.sampling, temperature=1.0, top_k=top_k)
    result = trainer.generator.generate(ids, mask, sampling, policy_version=version)
    width = result.completion_ids.shape[1]
    positions = (result.attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, P + C) left padding
    with torch.no_grad():
        logits = trainer.model(
            input_ids=result.input_ids, attention_mask=result.attention_mask, position_ids=positions
        ).logits
    scores = logits[:, -width - 1 : -1].float().log_softmax(dim=-1)  # (B, C, V) whole vocabulary
    full = scores.gather(2, result.completion_ids.unsqueeze(2)).squeeze(2)  # (B, C)
    kept = scores.topk(top_k, dim=-1).values.logsumexp(dim=-1)  # (B, C) log of the kept mass
    active = result.completion_mask.bool()
    gap = (result.sampler_logps - (full - kept)).abs()[active]
    assert gap.max() < 1e-3, f"max |vLLM - log(p / kept mass)| = {gap.max():.2e}"
    assert (-kept[active]).max() > 0.01  # mass was cut somewhere: log p alone would be off there
    # The trainer's replay of the truncation (renormalize_truncated_sampling) finds the same mass.
    ours, _, replayed = completion_logps(
        trainer.model,
        result.input_ids,
        result.attention_mask,
        width,
        truncation=Truncation(top_k, min_p_first=True),
    )  # (B, C) each
    gap = (result.sampler_logps - (ours - replayed)).abs()[active]
    assert gap.max() < 1e-3, f"max |vLLM - log(p / replayed kept mass)| = {gap.max():.2e}"


def assert_sync_reaches_the_engine(
    trainer: GRPOTrainer, model: torch.nn.Module, names: tuple[str, ...]
) -> None:
    """Item b: after a sync, vLLM's greedy completions equal our decoder's on the updated policy; after
    the weights are restored and synced again, the original completions come back."""
    ids, mask = prompts(trainer, [3, 4, 5])
    original = vllm_greedy(trainer, ids, mask, version=100)
    assert original == our_greedy(trainer, model, ids, mask)
    saved = perturb(model, names, scale=0.05, seed=1)
    changed = vllm_greedy(trainer, ids, mask, version=101)
    assert changed == our_greedy(trainer, model, ids, mask)
    assert changed != original  # the perturbation is seen: the test can fail
    restore(model, saved)
    assert vllm_greedy(trainer, ids, mask, version=102) == original  # and the prefix cache was reset


def assert_plain_policy_sync(trainer: GRPOTrainer, names: tuple[str, ...]) -> None:
    """Item b for full fine-tuning: the engine follows a plain (non-LoRA) policy, every weight sent."""
    model = load_model(str(trainer.model.get_base_model().name_or_path))
    policy = trainer.generator.policy
    trainer.generator.policy = lambda: model
    try:
        assert_sync_reaches_the_engine(trainer, model, names)
    finally:
        trainer.generator.policy = policy


def assert_ratios_near_one(ratio_means: list[float], ratio_maxes: list[float], bf16: bool) -> None:
    """The logged sampler ratios pi_old / pi_sampler are what the trainer's precision allows."""
    assert ratio_means and all(abs(mean - 1) < RATIO_MEAN_GAP[bf16] for mean in ratio_means), ratio_means
    assert all(0 < top < math.exp(SAMPLER_GAP[bf16]) for top in ratio_maxes), ratio_maxes


def assert_lora_run_moves_logs_and_resumes(tmp_path, settings: dict) -> None:
    """Item c: two optimizer steps through the engine, a checkpoint each; the adapter moves; the
    sampler ratios are logged (and near 1: the same weights, as near as the precision allows); the
    run resumes from its first checkpoint."""
    settings = settings | dict(max_steps=2, save_strategy="steps", save_steps=1)
    run = make_trainer(tmp_path, **settings)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    run.train()
    assert any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters() if n in before)
    logs = [entry for entry in run.state.log_history if "loss" in entry]
    assert len(logs) == 2
    ratios = ([entry["sampler/ratio_mean"] for entry in logs], [entry["sampler/ratio_max"] for entry in logs])
    assert_ratios_near_one(*ratios, bf16=run.args.bf16)
    for entry in logs:
        assert entry["generation/tokens_per_second"] > 0 and "reward" in entry
    assert (tmp_path / "checkpoint-1" / STATE_FILE).is_file()
    resumed = make_trainer(tmp_path, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.state.global_step == 2 and resumed.generator.version == 1


def assert_two_turn_tool_episodes(scored) -> None:
    """Item e: each episode called `add` (the first turn forced to), got its result, and answered after
    it; the tool's tokens are out of the loss and have no sampler log-prob."""
    for episode in scored.completions:
        assert [m["role"] for m in episode] == ["assistant", "tool", "assistant"]
        (call,) = episode[0]["tool_calls"]  # transformers' message shape: the call parsed out of the text
        arguments = call["function"]["arguments"]
        assert call["function"]["name"] == "add"
        assert episode[1]["content"] == str(arguments["a"] + arguments["b"])
    tool = scored.result.tool_mask.bool()
    assert tool.any(dim=1).all() and torch.all(scored.result.sampler_logps[tool] == 0)


def assert_seeded(trainer: GRPOTrainer) -> None:
    """Seeds: each request's seed comes from (seed, policy version, call, request), not from the
    process's random state: the first call after the weights of a version were sent samples the
    same completions again; the next call samples others."""
    ids, mask = prompts(trainer, [6, 6, 7, 7])
    trainer.generator.version = None
    first = completions(trainer.generator.generate(ids, mask, trainer.sampling, policy_version=200))
    second = completions(trainer.generator.generate(ids, mask, trainer.sampling, policy_version=200))
    torch.manual_seed(1234)
    trainer.generator.version = None  # the weights are sent again: call 1 of version 200 again
    again = completions(trainer.generator.generate(ids, mask, trainer.sampling, policy_version=200))
    assert again == first and second != first
