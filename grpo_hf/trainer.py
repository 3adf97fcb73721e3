"""`GRPOTrainer`: GRPO (DeepSeekMath, arXiv 2402.03300) as a `transformers.Trainer`.

How one generation round flows through the Trainer's loop:
- The train dataloader yields, per micro-step, this process's share of a whole generation batch
  (every prompt repeated G times; `GroupSampler`), the same batch `steps_per_generation x
  num_iterations` times in a row.
- `_prepare_inputs` generates and scores on the first of those micro-steps, gathers rewards from
  every process to compute group advantages, computes old / reference log-probs once, and splits
  the result into `steps_per_generation` micro-batches that the following micro-steps consume.
- With `dynamic_sampling` (DAPO), groups whose rewards are all equal are replaced by groups from
  extra generation rounds before the advantages are computed (`dynamic_sampling`).
- With `tools` / `environment_factory` a rollout is a multi-turn episode (`multi_turn`): the
  model's turns and the tool results between them, the results masked out of the loss.
- `compute_loss` is per-token log-probs of the completion tokens plus the pure `grpo_loss`.
The maths lives in `advantages`, `loss` and `logprobs`; this file only orchestrates.
"""

import json
import logging
import os
import time
from collections.abc import Callable

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from peft import PeftConfig
from torch import nn
from torch.utils.data import Sampler
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
)
from transformers.trainer_utils import rotate_checkpoints

from grpo_hf import rollout
from grpo_hf.advantages import combine_rewards, group_advantages
from grpo_hf.checkpoints import (
    NonFiniteGuard,
    SaveOnInterrupt,
    last_complete_checkpoint,
    read_round,
    read_state,
    write_round,
    write_state,
)
from grpo_hf.config import GRPOConfig
from grpo_hf.data import GroupSampler, check_prompt_dataset, extra_prompt_indices, split_batch, trim_padding
from grpo_hf.dynamic_sampling import ScoredRound, gather_round, sample_teaching_groups
from grpo_hf.engine import native_bf16
from grpo_hf.engine.generation import build_generator, sampling_settings
from grpo_hf.engine.logprobs import completion_logps
from grpo_hf.loss import adaptive_beta, grpo_loss, sampler_is_weights
from grpo_hf.metrics import IntervalMetrics, log_completion_table, round_metrics
from grpo_hf.models import disable_dropout, load_model, load_tokenizer, wrap_with_peft
from grpo_hf.multi_turn import episode_metrics, tool_episodes
from grpo_hf.reference import build_reference, mix_into_reference, reference_context
from grpo_hf.rollout_func import RolloutFunc, call_rollout_func
from grpo_hf.scoring import RewardFunc, RewardModel, reward_functions, reward_name, score_completions
from grpo_hf.sharding import parameters_for_mixing, prepare_reference, zero3_partitioned
from grpo_hf.tools import Toolbox

logger = logging.getLogger(__name__)


class _ReferenceSync(TrainerCallback):
    """Calls `GRPOTrainer.sync_reference` after every optimizer step."""

    def __init__(self, trainer: "GRPOTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.sync_reference()


class GRPOTrainer(Trainer):
    """Trainer for Group Relative Policy Optimization; see the module docstring for the data flow."""

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardFunc | str | PreTrainedModel | list,
        args: GRPOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: list[PreTrainedTokenizerBase | None] | None = None,
        peft_config: PeftConfig | None = None,
        ref_model: str | PreTrainedModel | None = None,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], object] | None = None,
        rollout_func: RolloutFunc | None = None,
        **kwargs,
    ):
        args = GRPOConfig(output_dir="outputs/grpo") if args is None else args
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None:
                check_prompt_dataset(dataset, name, needs_chat=bool(tools or environment_factory))
        self.toolbox = Toolbox(tools, environment_factory) if tools or environment_factory else None
        if rollout_func is not None and self.toolbox is not None:
            raise ValueError(
                "rollout_func and tools / environment_factory both make the completions; pass one."
            )
        self.rollout_func = rollout_func
        if eval_dataset is not None:
            args.check_eval_batch()
        self.reward_funcs = reward_functions(reward_funcs, reward_processing_classes, args.reward_weights)
        if isinstance(model, str):
            processing_class = processing_class or load_tokenizer(model)
            model = load_model(model)
        elif processing_class is None:
            processing_class = load_tokenizer(model.name_or_path)
        if processing_class.pad_token_id is None:
            raise ValueError(
                "The tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos_token) and pass it "
                "as processing_class."
            )
        if args.disable_dropout:
            disable_dropout(model)
        if peft_config is not None:
            model = wrap_with_peft(model, peft_config, args.gradient_checkpointing)
        if args.sync_ref_model and peft_config is not None:
            raise ValueError(
                "sync_ref_model needs a copied reference; with peft_config the base model is it."
            )
        super().__init__(
            model=model,
            args=args,
            data_collator=lambda rows: rows,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        self.loss_is_scaled_for_ga = False  # the Trainer divides our loss by the accumulation steps
        self.ref_model = self._build_reference(ref_model, peft_config is not None)
        for reward in self.reward_funcs:
            if isinstance(reward, RewardModel):
                reward.model = self.accelerator.prepare_model(reward.model, evaluation_mode=True)
        self._log_precision()
        self.eos_token_ids = rollout.eos_token_ids(self.model, processing_class)
        self.sampling = sampling_settings(args, self.eos_token_ids, processing_class.pad_token_id)
        self.generator = build_generator(
            args,
            self.accelerator,
            self.model,
            lambda: self.accelerator.unwrap_model(self.model),
            processing_class,
            sharded=self.is_fsdp_enabled or self.is_deepspeed_enabled,
        )
        self.reward_weights = torch.tensor(
            args.reward_weights or [1.0] * len(self.reward_funcs), dtype=torch.float32
        )
        self.beta = args.beta
        self._micro_step = 0
        self._buffer: list[dict] = []
        self._extra_prompts = 0  # position in dynamic sampling's extra prompt stream (checkpointed)
        self._round_kl: list[float] = []
        self.metrics = IntervalMetrics()
        self._completion_rows: list[dict] = []
        self.add_callback(NonFiniteGuard(self.record))
        self.add_callback(_ReferenceSync(self))
        self.interrupt = SaveOnInterrupt()
        self.add_callback(self.interrupt)

    def _build_reference(self, ref_model: str | PreTrainedModel | None, lora: bool) -> nn.Module | None:
        """The frozen reference (None when beta = 0 or with LoRA), prepared like the policy."""
        partitioned = zero3_partitioned(self.model)
        if ref_model is None and self.args.beta > 0 and not lora and partitioned and self.model.name_or_path:
            # ZeRO-3 partitioned the policy as it loaded (zero.Init): load the reference the same way.
            logger.info(
                "ZeRO-3: loading the reference from %s instead of copying the policy.",
                self.model.name_or_path,
            )
            ref_model = self.model.name_or_path
        if isinstance(ref_model, str):
            ref_model = load_model(ref_model)
        reference = build_reference(self.model, self.args.beta, ref_model)
        return None if reference is None else prepare_reference(self.accelerator, reference, self.model)

    # ---- Data ---------------------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> Sampler:
        args = self.args
        return GroupSampler(
            num_prompts=len(train_dataset if train_dataset is not None else self.train_dataset),
            num_generations=args.num_generations,
            prompts_per_batch=args.generation_batch_size // args.num_generations,
            repeats=self.round_length,
            seed=args.seed,
        )

    def get_train_dataloader(self):
        """One batch per micro-step: this process's slice of a whole generation batch."""
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer needs a train_dataset to train.")
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_eval_sampler(self, eval_dataset: Dataset) -> Sampler:
        return GroupSampler(len(eval_dataset), self.args.num_generations, 1, 1, self.args.seed)

    def _log_precision(self) -> None:
        """Say which precision precision='auto' chose, or that an explicit --bf16 will be emulated."""
        native, line = native_bf16(use_cpu=self.args.device.type == "cpu")
        if not self.accelerator.is_main_process:
            return
        if self.args.precision == "auto":
            logger.warning(line)
        elif self.args.bf16 and not native:
            logger.warning(
                "--bf16 is set but bf16 is not native here (%s): its matmuls are emulated, several times "
                "slower than float32. Set precision='auto' (or drop --bf16) to train in float32.",
                line.split(", ", 1)[1],
            )

    # ---- Generation round ---------------------------------------------------------------------

    def _prepare_inputs(self, inputs: list[dict]) -> dict[str, torch.Tensor]:
        if not self.model.training:
            return self._generate_and_score(inputs)[0]
        args = self.args
        if self._micro_step % self.round_length == 0:
            self._update_adaptive_beta()
            self._buffer = self._generate_and_score(inputs)
        batch = self._buffer[self._micro_step % args.steps_per_generation]
        self._micro_step += 1
        return batch

    @property
    def round_length(self) -> int:
        """Micro-steps fed by one generation round."""
        return self.args.steps_per_generation * self.args.num_iterations

    def _generate_and_score(self, rows: list[dict]) -> list[dict[str, torch.Tensor]]:
        """Generate, score and prepare one generation batch; return its micro-batches."""
        args = self.args
        scored = self._sample_and_score(rows)
        if args.dynamic_sampling and self.model.training:
            scored = self._dynamically_sampled(scored)
        result, prompts, completions = scored.result, scored.prompts, scored.completions
        rewards_per_func, seconds = scored.rewards_per_func, scored.seconds
        advantages, rewards = self._advantages(rewards_per_func)
        loss_mask = result.completion_mask  # (B, C)
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~result.truncated).unsqueeze(1)
        if result.tool_mask is not None:  # tool results: context, not the policy's choice
            loss_mask = loss_mask * (1 - result.tool_mask)
        self._record_round(
            result, rewards_per_func, rewards, advantages, (scored.errors, scored.retried), seconds
        )
        self._record_completion_rows(prompts, completions, rewards)
        batch = {
            "input_ids": result.input_ids,
            "attention_mask": result.attention_mask,
            "completion_mask": loss_mask,
            "advantages": advantages,
        }
        if result.sampler_logps is not None:
            batch["sampler_logps"] = result.sampler_logps
        parts = split_batch(batch, args.steps_per_generation if self.model.training else 1)
        normalizers = self._dapo_normalizers([part["completion_mask"] for part in parts])
        return [
            self._complete_micro_batch(part, normalizer)
            for part, normalizer in zip(parts, normalizers, strict=True)
        ]

    def _dapo_normalizers(self, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per micro-batch: the DAPO denominator that makes each optimizer step a token mean.

        The Trainer divides each micro-step's loss by gradient_accumulation_steps and DDP averages
        over processes, so a micro-batch feeding an optimizer step with n active tokens (summed over
        that step's micro-batches and every process) divides its token sum by n / (P * GA). With
        several optimizer steps per round (steps_per_generation = k * GA) each step has its own n;
        with one round per several steps (GA a multiple of steps_per_generation) n is the round's,
        and the step's gradient is the mean of its rounds' token means. In evaluation (one part per
        process) n / P makes the mean of the processes' losses the global token mean.
        """
        processes = self.accelerator.num_processes
        counts = torch.stack([mask.sum() for mask in masks]).float()  # (S,)
        counts = self.accelerator.gather(counts).view(processes, -1).sum(dim=0)  # (S,) over processes
        per_step = min(self.args.gradient_accumulation_steps, len(masks)) if self.model.training else 1
        totals = counts.view(-1, per_step).sum(dim=1)  # (S / per_step,) active tokens per optimizer step
        return [totals[i // per_step] / (processes * per_step) for i in range(len(masks))]

    def _sample_and_score(self, rows: list[dict]) -> ScoredRound:
        """Generate one completion per row (rows repeat each prompt G times) and score them."""
        args, device = self.args, self.accelerator.device
        prompts = [row["prompt"] for row in rows]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        start = time.perf_counter()
        if self.rollout_func is not None:
            result, completions, extra = call_rollout_func(
                self.rollout_func, prompts, self, self.processing_class, self.eos_token_ids, device
            )
            columns.update(extra)
        elif self.toolbox is not None:
            result, completions, environments = self._tool_episodes(rows)
            if environments is not None:
                columns["environments"] = environments
        else:
            prompt_ids, prompt_mask = rollout.tokenize_prompts(
                self.processing_class,
                [rollout.render_prompt(self.processing_class, p) for p in prompts],
                args.max_prompt_length,
                device,
            )
            result = self.generate_completions(prompt_ids, prompt_mask)
            completions = rollout.decode_completions(
                self.processing_class, result, chat=not isinstance(prompts[0], str)
            )
        seconds = time.perf_counter() - start
        completion_ids = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(result.completion_ids, result.completion_mask, strict=True)
        ]
        rewards_per_func, errors, retried = score_completions(
            self.reward_funcs, prompts, completions, completion_ids, columns, args.reward_error_policy, device
        )
        return ScoredRound(result, prompts, completions, rewards_per_func, errors, retried, seconds)

    def _tool_episodes(self, rows: list[dict]) -> tuple[rollout.Rollout, list[list[dict]], list | None]:
        """Multi-turn episodes with the run's tools: rollout, messages, environments (or None)."""
        args = self.args
        tools, environments = self.toolbox.for_episodes(rows)
        result, messages, episodes = tool_episodes(
            [row["prompt"] for row in rows],
            tools,
            self.toolbox.schemas,
            self.processing_class,
            self.generate_completions,
            max_prompt_length=args.max_prompt_length,
            max_iterations=args.max_tool_calling_iterations,
            max_completion_length=args.max_completion_length,
            timeout=args.tool_timeout,
            device=self.accelerator.device,
            any_active=self.generator.any_active,
        )
        self.record(episode_metrics(episodes))
        return result, messages, environments

    def _dynamically_sampled(self, first: ScoredRound) -> ScoredRound:
        """DAPO dynamic sampling: this process's share of a batch of groups that teach."""
        args = self.args
        weights = self.reward_weights.to(first.rewards_per_func.device)
        scored, metrics = sample_teaching_groups(
            first,
            sample_more=lambda: self._sample_and_score(self._extra_prompt_rows(len(first.prompts))),
            gather=lambda scored: gather_round(self.accelerator, scored, self.processing_class.pad_token_id),
            combine=lambda rewards_per_func: combine_rewards(rewards_per_func, weights),
            num_generations=args.num_generations,
            max_extra_rounds=args.max_dynamic_sampling_rounds,
            pad_token_id=self.processing_class.pad_token_id,
            process_index=self.accelerator.process_index,
        )
        self.record(metrics)
        return scored

    def _extra_prompt_rows(self, share: int) -> list[dict]:
        """This process's rows of one extra round: the extra stream's next prompts, G rows each."""
        args = self.args
        count = args.generation_batch_size // args.num_generations
        indices = extra_prompt_indices(len(self.train_dataset), args.seed, self._extra_prompts, count)
        self._extra_prompts += count
        start = self.accelerator.process_index * share
        mine = [i for i in indices for _ in range(args.num_generations)][start : start + share]
        fetched = {i: self.train_dataset[i] for i in dict.fromkeys(mine)}  # each prompt read once
        return [fetched[i] for i in mine]

    def _complete_micro_batch(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> dict:
        """Trim padding and add old / reference log-probs (no grad, once per round)."""
        batch = trim_padding(batch)
        batch["dapo_normalizer"] = normalizer
        with torch.no_grad(), self.compute_loss_context_manager():  # the loss's precision (bf16 autocast)
            if self.needs_old_logps():
                batch["old_logps"] = self.completion_logps(self.model_wrapped, batch)[0]
            if self.beta > 0:
                with reference_context(self.model, self.ref_model) as ref:
                    batch["ref_logps"] = self.completion_logps(ref, batch)[0]
        return batch

    def completion_logps(
        self, model: nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, C) log-probs of the batch's completion tokens under `model` (and their entropy)."""
        return completion_logps(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"].shape[1],
            self.args.temperature,
            with_entropy=with_entropy,
            gradient_checkpointing=self.args.gradient_checkpointing,
            entropy_grad=self.args.entropy_coef != 0,  # otherwise a metric: no gradient needed
        )

    def needs_old_logps(self) -> bool:
        """Old log-probs differ from the current ones only if the policy moves within a round."""
        args = self.args
        return self.model.training and (
            args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
        )

    def generate_completions(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int | None = None
    ) -> rollout.Rollout:
        """Sample one completion per row, of at most `max_new_tokens` (default max_completion_length)
        tokens, from the policy of this optimizer step. Tests override this to feed fixed completions."""
        sampling = (
            self.sampling if max_new_tokens is None else self.sampling.with_max_new_tokens(max_new_tokens)
        )
        return self.generator.generate(prompt_ids, prompt_mask, sampling, self.state.global_step)

    def _advantages(self, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather every process's rewards, normalise per group, keep this process's slice."""
        all_rewards = self.accelerator.gather(rewards_per_func)  # (N, F)
        unscored = all_rewards.isnan().all(dim=1)
        if unscored.any():
            raise ValueError(
                f"{int(unscored.sum())} completions got None from every reward function; make at least one "
                "reward function return a number for every sample."
            )
        rewards = combine_rewards(all_rewards, self.reward_weights.to(all_rewards.device))  # (N,)
        advantages = group_advantages(rewards, self.args.num_generations, self.args.scale_rewards)  # (N,)
        n = rewards_per_func.shape[0]
        start = self.accelerator.process_index * n
        return advantages[start : start + n], rewards

    # ---- Loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        logps, entropy = self.completion_logps(model, inputs, with_entropy=True)  # (B, C), (B, C)
        old = inputs["old_logps"] if "old_logps" in inputs else logps.detach()  # (B, C) pi_old
        loss, metrics = grpo_loss(
            logps,
            inputs.get("old_logps"),
            inputs.get("ref_logps"),
            inputs["advantages"],
            inputs["completion_mask"],
            loss_type=args.loss_type,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            delta=args.delta,
            beta=self.beta,
            kl_estimator=args.kl_estimator,
            importance_sampling_level=args.importance_sampling_level,
            max_completion_length=args.max_completion_length,
            entropy=entropy,
            entropy_coef=args.entropy_coef,
            dapo_normalizer=inputs["dapo_normalizer"],
            sampler_weights=self._sampler_weights(old, inputs),
        )
        self._record_loss_metrics(metrics, old, inputs)
        return (loss, None) if return_outputs else loss

    def _sampler_weights(self, old: torch.Tensor, inputs: dict) -> torch.Tensor | None:
        """The truncated importance-sampling weights pi_old / pi_sampler, if configured."""
        if "sampler_logps" not in inputs or self.args.sampler_is_cap is None:
            return None
        return sampler_is_weights(old, inputs["sampler_logps"], self.args.sampler_is_cap)

    def _record_loss_metrics(self, metrics: dict[str, torch.Tensor], old: torch.Tensor, inputs: dict) -> None:
        """Record a micro-step's loss metrics and, for completions drawn by our decode loop, how far the
        sampler's token probabilities are from the policy's (ratio pi_old / pi_sampler, mean and max
        over tokens). They reach the host in one transfer, not one `.item()` (a device sync) each."""
        mask = inputs["completion_mask"]  # (B, C)
        scalars = {"tokens": mask.sum(), **metrics}
        if "sampler_logps" in inputs:
            ratio = torch.exp(old - inputs["sampler_logps"]) * mask.to(old.dtype)  # (B, C)
            scalars |= {"sampler/ratio_sum": ratio.sum(), "sampler/ratio_max": ratio.max()}
        values = dict(zip(scalars, torch.stack([v.float() for v in scalars.values()]).tolist(), strict=True))
        tokens = values.pop("tokens")
        if "sampler/ratio_sum" in values:
            self.record_token_means(
                {"sampler/ratio_mean": values.pop("sampler/ratio_sum") / max(tokens, 1)}, tokens
            )
            self.record({"sampler/ratio_max": values.pop("sampler/ratio_max")})
        if "kl" in values and self.model.training:
            self._round_kl.append(values["kl"])
        self.record_token_means(values, tokens)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs).detach()
        return loss, None, None

    # ---- Adaptive KL and reference sync -------------------------------------------------------

    def _update_adaptive_beta(self) -> None:
        if self.args.target_kl is None or not self._round_kl:
            return
        kl = self.accelerator.reduce(
            torch.tensor(sum(self._round_kl) / len(self._round_kl), device=self.accelerator.device), "mean"
        ).item()
        self.beta = adaptive_beta(
            self.beta, kl, self.args.target_kl, self.args.generation_batch_size, self.args.kl_horizon
        )
        self._round_kl = []

    def sync_reference(self) -> None:
        """Reference sync (TR-DPO) every ref_model_sync_steps optimizer steps."""
        args = self.args
        if args.sync_ref_model and self.state.global_step % args.ref_model_sync_steps == 0:
            ref = self.accelerator.unwrap_model(self.ref_model)
            policy = self.accelerator.unwrap_model(self.model)
            with parameters_for_mixing(self.accelerator, ref, policy):
                mix_into_reference(ref, policy, args.ref_model_mixup_alpha)

    # ---- Metrics ------------------------------------------------------------------------------

    def record(self, values: dict[str, float]) -> None:
        """Add metric values to the current logging interval (see `metrics.IntervalMetrics`)."""
        self.metrics.record("train" if self.model.training else "eval", values)

    def record_token_means(self, means: dict[str, float], tokens: float) -> None:
        """Add per-token means over `tokens` active tokens, logged as means over every token."""
        self.metrics.record_token_means("train" if self.model.training else "eval", means, tokens)

    def _record_round(self, result, rewards_per_func, rewards, advantages, error_counts, seconds) -> None:
        gather = self.accelerator.gather
        lengths = gather(result.completion_mask.sum(dim=1).float())  # (N,)
        values = round_metrics(
            rewards,
            gather(rewards_per_func),
            [reward_name(func) for func in self.reward_funcs],
            gather(advantages),
            lengths,
            gather(result.truncated.float()),
            self.args.num_generations,
        )
        values["generation/tokens_per_second"] = (
            lengths.sum().item() / max(seconds, 1e-9) / self.accelerator.num_processes
        )
        counts = torch.tensor(error_counts, dtype=torch.float32, device=rewards.device)  # (2,)
        values["reward_errors"], values["reward_retried_batches"] = (
            gather(counts).view(-1, 2).sum(dim=0).tolist()
        )
        values["beta"] = self.beta
        self.record(values)

    def _record_completion_rows(self, prompts, completions, rewards) -> None:
        if not self.args.log_completions:
            return
        n = len(prompts)
        start = self.accelerator.process_index * n
        local_rewards = rewards[start : start + n].tolist()
        rows = [
            {
                "step": self.state.global_step,
                "prompt": rollout.message_text(p),
                "completion": rollout.transcript(c),
                "reward": r,
            }
            for p, c, r in zip(prompts, completions, local_rewards, strict=True)
        ]
        self._completion_rows = gather_object(rows)[: self.args.num_completions_to_print]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the interval's GRPO metrics (`metrics.IntervalMetrics.reduce`), then log as usual."""
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({prefix + k: v for k, v in self.metrics.reduce(mode, self.accelerator).items()})
        super().log(logs, start_time)
        if self._completion_rows and self.is_world_process_zero():
            log_completion_table(self._completion_rows, self.args.report_to, self.state.global_step)
            self._completion_rows = []

    # ---- Checkpoints --------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        """Save as the Trainer does, then the GRPO state (the completion marker), then rotate."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # no rotation before this checkpoint is complete
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial)
        folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        if self._micro_step % self.round_length:
            write_round(folder, self.accelerator.process_index, self._buffer)
        self.accelerator.wait_for_everyone()  # every process's files are in before the marker
        if self.args.should_save:
            write_state(
                folder, {"beta": self.beta, "round_kl": self._round_kl, "extra_prompts": self._extra_prompts}
            )
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Train; when resuming, restore the adaptive beta and the position in the generation round.

        `resume_from_checkpoint=True` takes the newest complete checkpoint in output_dir.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir}."
                )
        if resume_from_checkpoint:
            state = read_state(resume_from_checkpoint)
            self.beta, self._round_kl = state["beta"], state["round_kl"]
            self._extra_prompts = state.get("extra_prompts", 0)  # absent in checkpoints older than it
            with open(os.path.join(resume_from_checkpoint, "trainer_state.json")) as f:
                step = json.load(f)["global_step"]
            self._micro_step = step * self.args.gradient_accumulation_steps
            if self._micro_step % self.round_length:
                self._buffer = read_round(
                    resume_from_checkpoint, self.accelerator.process_index, self.accelerator.device
                )
        with self.interrupt.catching_signals():
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
