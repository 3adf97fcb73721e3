"""`GRPOTrainer`: GRPO (DeepSeekMath, arXiv 2402.03300) as a `transformers.Trainer`; this file only
orchestrates. One generation round, and where each step lives:

- rows: per micro-step the dataloader yields this process's share of a generation batch, each
  prompt G times (`data.batches.GroupSampler`; a stream: `data.streaming`), the same batch
  `steps_per_generation x num_iterations` times in a row;
- completions and rewards (`_prepare_inputs`, on the first of those micro-steps;
  `episodes.scored_round`): one sampling call (`data.rollout.sample_completions` through the
  generator `engine.backends.build_generator` chose), multi-turn tool episodes (`episodes.multi_turn`,
  `episodes.tools`; environments: `episodes.environments`) or the user's `episodes.rollout_func`,
  scored by `rewards.scoring`; async GRPO (max_staleness >= 1): sampled and scored ahead on a
  thread, from rows read ahead (`episodes.async_rounds`);
- DAPO's dynamic sampling refills the batch with teaching groups
  (`episodes.dynamic_sampling`); group advantages over every process (`algorithm.advantages`);
- the round's loss tensors and micro-batches (`data.batches`), old / reference log-probs once
  (`training.logprob_passes`: per micro-batch, or in passes cut by `token_budget`);
- `compute_loss`: log-probs of the completion tokens, then the pure `algorithm.loss.grpo_loss` with
  the masks and sampler weights of `algorithm.masks`;
- around it (`training/`): metrics, completion logs, the adaptive KL and entropy coefficients, checkpoints
  with the GRPO state and, saved inside a round, its remaining micro-batches; the model card.
"""

import functools
import logging
import os
import threading
from collections.abc import Callable
from contextlib import nullcontext

import torch
from datasets import Dataset, IterableDataset
from peft import PeftConfig
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback, set_seed
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import rotate_checkpoints

from grpo_hf.algorithm import masks
from grpo_hf.algorithm.advantages import batch_advantages
from grpo_hf.algorithm.loss import dapo_normalizers, grpo_loss
from grpo_hf.algorithm.masks import gather_ragged, policy_weights
from grpo_hf.algorithm.sampler_correction import on_policy_support
from grpo_hf.config.async_grpo_config import trl_async_arguments
from grpo_hf.config.grpo_config import GRPOConfig, default_output_dir
from grpo_hf.data import batches, rollout
from grpo_hf.data.rollout import ScoredRound
from grpo_hf.data.streaming import extra_prompt_source, group_stream, read_in_process
from grpo_hf.engine import precision_line
from grpo_hf.engine.backends import build_generator
from grpo_hf.engine.logprobs import TokenScores, completion_logps
from grpo_hf.episodes.async_rounds import async_rounds, stopping
from grpo_hf.episodes.dynamic_sampling import ExtraRounds, trainer_dynamic_sampling
from grpo_hf.episodes.environments import (
    EnvironmentFactory,
    check_reward_source,
    environment_pool,
    train_dataset_or_placeholder,
)
from grpo_hf.episodes.multi_turn import recorded_episodes
from grpo_hf.episodes.rollout_func import RolloutFunc
from grpo_hf.episodes.scored_round import sample_and_score
from grpo_hf.episodes.tools import Toolbox, check_tool_call_format
from grpo_hf.models.policy import load_policy, model_init_kwargs, prepare_policy, reward_model_loading
from grpo_hf.models.reference import ReferenceSync, load_reference
from grpo_hf.rewards.scoring import (
    RewardFunc,
    RewardModel,
    reward_name,
    reward_setup,
)
from grpo_hf.training import logprob_passes as passes
from grpo_hf.training import metrics as training_metrics
from grpo_hf.training.checkpoints import (
    NonFiniteGuard,
    SaveOnInterrupt,
    checkpoint_to_resume,
    complete_checkpoint,
    grpo_state,
    load_grpo_state,
    read_checkpoint,
)
from grpo_hf.training.completion_logs import CompletionLog, completion_rows
from grpo_hf.training.entropy_control import EntropyCoefficient
from grpo_hf.training.kl_control import KLControl
from grpo_hf.training.metrics import IntervalMetrics, StepTimer, round_metrics
from grpo_hf.training.model_card import ModelCardWriter, Tags
from grpo_hf.training.moe import RouterAuxLoss

logger = logging.getLogger(__name__)


class GRPOTrainer(Trainer):
    """Trainer for Group Relative Policy Optimization; see the module docstring for the data flow."""

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardFunc | str | PreTrainedModel | list | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        quantization_config=None,
        peft_config: PeftConfig | None = None,
        tools: list[Callable] | None = None,
        rollout_func: RolloutFunc | None = None,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
        ref_model: str | PreTrainedModel | None = None,
        **kwargs,
    ):
        """TRL 1.16's arguments, in TRL's order; then `ref_model` (ours: a reference other than the
        initial policy) and any other `transformers.Trainer` keyword."""
        args = GRPOConfig(output_dir=default_output_dir(model)) if args is None else args
        set_seed(args.seed)  # before the models and adapters are made (PEFT's start random), as TRL does
        # First, so that a Hub repo for the completions that cannot be made fails before any model work.
        self.completion_log = CompletionLog(args, args.process_index == 0)
        pool = self.environment_pool = environment_pool(environment_factory, args)
        if eval_dataset is not None:
            args.check_eval_batch()
        train_dataset = train_dataset_or_placeholder(train_dataset, pool, args)
        batches.check_datasets(
            args, train_dataset, eval_dataset, needs_chat=bool(tools or pool), environments=pool
        )
        self._set_rollout_sources(tools, rollout_func)
        init_kwargs = model_init_kwargs(args, quantization_config)
        self.reward_funcs, self.reward_processing_classes, self.reward_weights = reward_setup(
            reward_funcs,
            reward_processing_classes,
            args.reward_weights,
            pool.reward_functions() if pool else [],
            **reward_model_loading(args),
        )
        self.reward_func_names = [reward_name(func) for func in self.reward_funcs]
        check_reward_source(self.reward_funcs)
        model, processing_class = load_policy(model, processing_class, args, init_kwargs)
        if self.toolbox is not None:
            check_tool_call_format(processing_class)
        model = prepare_policy(model, args, peft_config)
        self.router_aux = RouterAuxLoss(model, args.router_aux_loss_coef)
        super().__init__(
            model=model,
            args=args,
            data_collator=batches.keep_rows,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        self.loss_is_scaled_for_ga = False  # the Trainer divides our loss by the accumulation steps
        passes.check_policy_passes(args, self.is_deepspeed_enabled, self.router_aux.coef)
        lora = peft_config is not None
        self.ref_model = load_reference(self.accelerator, self.model, args, ref_model, lora, init_kwargs)
        for reward in self.reward_funcs:
            if isinstance(reward, RewardModel):
                reward.model = self.accelerator.prepare_model(reward.model, evaluation_mode=True)
        line = precision_line(args.precision, args.bf16, use_cpu=args.device.type == "cpu")
        if line is not None and self.accelerator.is_main_process:
            logger.warning(line)
        self._set_up_generation(processing_class)
        self._set_up_training_state(args)
        self.async_rounds = async_rounds(self)  # async GRPO (max_staleness >= 1), a callback after the others

    def _set_rollout_sources(self, tools: list[Callable] | None, rollout_func: RolloutFunc | None) -> None:
        """What makes the completions besides the policy: tools (given, or the environments' methods)
        for multi-turn episodes, or the user's rollout_func."""
        pool = self.environment_pool
        toolbox = Toolbox(tools, pool.probes if pool else None)
        self.toolbox, self.tools = (toolbox if toolbox.tools else None), toolbox.tools
        if rollout_func is not None and self.toolbox is not None:
            raise ValueError(
                "rollout_func and tools / environment_factory both make the completions; pass one."
            )
        self.rollout_func = rollout_func
        self.environments: list | None = None  # the environments of the latest rollouts (TRL's attribute)
        self._environments_lock = threading.Lock()  # `_sample_and_score`
        self._thread_generate = threading.local()  # `generate_completions` on async GRPO's generation thread

    def _set_up_generation(self, processing_class: PreTrainedTokenizerBase) -> None:
        """The sampling settings and the generator (`engine.backends.build_generator`)."""
        self.eos_token_ids = rollout.eos_token_ids(self.model, processing_class)
        self.sampling = self.args.sampling(self.eos_token_ids, processing_class.pad_token_id)
        self.generator = build_generator(
            self.args.generation_settings(),
            self.sampling,
            self.accelerator,
            self.model,
            lambda: self.accelerator.unwrap_model(self.model),
            processing_class,
            sharded=self.is_fsdp_enabled or self.is_deepspeed_enabled,
        )

    def _set_up_training_state(self, args: GRPOConfig) -> None:
        """The loss's settings, what moves during training (beta, the entropy coefficient, the
        position in a generation round and in the extra prompt stream; checkpointed), the metrics,
        and the callbacks."""
        self.kl_control = KLControl(
            args, lambda t: self.accelerator.reduce(t.to(self.accelerator.device), "mean")
        )
        self.loss_settings = args.loss_settings()
        self.entropy_control = EntropyCoefficient(
            args, lambda t: self.accelerator.reduce(t, "sum"), self.record
        )
        self.add_callback(self.entropy_control)
        self._micro_step = 0
        self._buffer: list[dict] = []
        source = extra_prompt_source(
            self.train_dataset, batches.data_order_seed(args), self.toolbox is not None
        )
        self.extra_rounds = ExtraRounds(source, args.generation_batch_size, args.num_generations)
        self.metrics = IntervalMetrics()
        self._eval_prefix = "eval"  # the running evaluation's metric prefix (`evaluate`)
        self.add_callback(StepTimer(self.record))
        self.add_callback(self.completion_log)
        self.add_callback(NonFiniteGuard(self.record))
        self.add_callback(ReferenceSync(self.accelerator, lambda: self.model, self.ref_model))
        self.interrupt = SaveOnInterrupt(self.accelerator)
        self.add_callback(self.interrupt)
        self.model_card = ModelCardWriter(self)  # tags the model for the Hub, as TRL does

    # ---- Data ---------------------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> Sampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return batches.GroupSampler.for_training(self.args, len(dataset), self.round_length)

    def get_train_dataloader(self):
        """One batch per micro-step: this process's slice of a whole generation batch."""
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's; async GRPO reads the rows ahead for its generation thread (`episodes.async_rounds`)."""
        batches = self.async_rounds.ahead(epoch_iterator) if self.async_rounds else epoch_iterator
        return super().get_batch_samples(batches, num_batches, device)

    def _get_eval_sampler(self, eval_dataset: Dataset) -> Sampler:
        return batches.GroupSampler.for_evaluation(self.args, len(eval_dataset))

    def _get_dataloader(
        self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None
    ) -> DataLoader:
        """The Trainer's dataloader; a stream's rows come in group order (`streaming.GroupStream`),
        read in this process."""
        if not is_training:
            self.args.check_eval_batch()  # also for a dataset handed to evaluate() directly
        if not batches.is_stream(dataset):
            return super()._get_dataloader(
                dataset, description, batch_size, sampler_fn, is_training, dataloader_key
            )
        name = "train_dataset" if is_training else "eval_dataset"
        name += f"[{dataloader_key!r}]" if dataloader_key not in (None, "eval") else ""
        stream = group_stream(dataset, self.args, name, self.toolbox is not None, training=is_training)
        with read_in_process(self.args):
            return super()._get_dataloader(stream, description, batch_size, None, is_training, dataloader_key)

    def _set_signature_columns_if_needed(self) -> None:
        """remove_unused_columns=True keeps only 'prompt' (the model's forward takes no dataset column)."""
        self._signature_columns = ["prompt"]

    # ---- Generation round ---------------------------------------------------------------------

    def _prepare_inputs(self, inputs: list[dict]) -> dict[str, torch.Tensor]:
        if not self.model.training:
            return self._generate_and_score(inputs)[0]
        args = self.args
        if self._micro_step % self.round_length == 0:
            self.kl_control.next_round()
            self._buffer = self._generate_and_score(inputs)
        batch = self._buffer[self._micro_step % args.steps_per_generation]
        self._micro_step += 1
        return batch

    @property
    def group_size(self) -> int:
        """Completions per prompt: num_generations in training, num_generations_eval in evaluation."""
        return self.args.num_generations if self.model.training else self.args.num_generations_eval

    @property
    def round_length(self) -> int:
        """Micro-steps fed by one generation round."""
        return self.args.steps_per_generation * self.args.num_iterations

    def _generate_and_score(self, rows: list[dict]) -> list[dict[str, torch.Tensor]]:
        """Generate, score and prepare one generation batch; return its micro-batches."""
        args = self.args
        ahead = self.async_rounds and self.model.training  # async GRPO: sampled on its thread already
        scored = recorded_episodes(self, self.async_rounds.take() if ahead else self._sample_and_score(rows))
        if args.dynamic_sampling and self.model.training:
            scored = trainer_dynamic_sampling(self, scored)
        all_rewards = self.accelerator.gather(scored.rewards_per_func)  # (N, F) every process's
        aggregated, all_advantages = batch_advantages(
            all_rewards,
            self.reward_weights,
            self.group_size,
            args.multi_objective_aggregation,
            args.scale_rewards,
        )
        start = self.accelerator.process_index * len(scored.prompts)
        advantages = all_advantages[start : start + len(scored.prompts)]  # (B,) this process's rows
        self._record_round(scored, all_rewards, aggregated, all_advantages)
        if args.log_completions:
            rows = completion_rows(scored, self.reward_func_names, self.reward_weights, advantages)
            self.completion_log.record(rows)
        batch = batches.round_batch(scored.result, advantages, args.mask_truncated_completions)
        if args.token_budget is not None:  # rows dealt to processes, old / reference passes cut, by tokens
            batch = passes.balanced_round(self, batch)
            batch = passes.round_logps(self, batch, args.token_budget)
        parts = batches.split_batch(batch, args.steps_per_generation if self.model.training else 1)
        counts = torch.stack([part["completion_mask"].sum() for part in parts]).float()  # (S,)
        counts = self.accelerator.gather(counts).view(self.accelerator.num_processes, -1)  # (P, S)
        per_step = min(args.gradient_accumulation_steps, len(parts)) if self.model.training else 1
        normalizers = dapo_normalizers(counts, per_step)
        parts = [
            self._complete_micro_batch(part, normal) for part, normal in zip(parts, normalizers, strict=True)
        ]
        if args.token_budget is not None:
            passes.add_policy_passes(self, parts, args.token_budget)
        return parts

    def _sample_and_score(
        self, rows: list[dict], generate: Callable | None = None, state: TrainerState | None = None
    ) -> ScoredRound:
        """Generate one completion per row (rows repeat each prompt G times) and score them (async GRPO's
        thread passes its `generate` for `generate_completions`, and the reward functions' trainer_state).
        With environments, one call at a time (the thread's rounds and evaluation share one pool)."""
        with self._environments_lock if self.environment_pool is not None else nullcontext():
            return sample_and_score(self, rows, generate, state or self.state)

    def _complete_micro_batch(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> dict:
        """Trim padding and add old / reference log-probs (no grad, once per round), one pass per
        micro-batch unless token_budget cut the round's passes (`training.logprob_passes`)."""
        batch = batches.trim_padding(batch, self.args.pad_to_multiple_of)
        batch["dapo_normalizer"] = normalizer
        if self.args.token_budget is None:
            batch = passes.pass_logps(self, batch)
        return batch

    def completion_logps(
        self, model: nn.Module, batch: dict[str, Tensor], with_entropy: bool = False, replay: bool = True
    ) -> TokenScores:
        """(B, C) log-probs of the batch's completion tokens under `model` (their entropy; with `replay`,
        the policy's passes, the mass the sampler's truncation keeps: `renormalize_truncated_sampling`)."""
        return completion_logps(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"].shape[1],
            self.args.temperature,
            with_entropy=with_entropy,
            gradient_checkpointing=self.args.gradient_checkpointing,
            entropy_grad=self.entropy_control.applied() != 0,  # otherwise a metric: no gradient needed
            truncation=self.loss_settings.sampler_truncation if replay else None,
        )

    def needs_old_logps(self) -> bool:
        """Old log-probs differ from the current ones only if the policy moves within a round."""
        return self.model.training and self.args.policy_moves_within_round

    def generate_completions(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int | None = None
    ) -> rollout.Rollout:
        """Sample one completion per row, of at most `max_new_tokens` (default max_completion_length)
        tokens, from the policy of this optimizer step. Tests override this to feed fixed completions."""
        # A rollout_func on async GRPO's generation thread: this process alone.
        if (thread_generate := getattr(self._thread_generate, "call", None)) is not None:
            return thread_generate(prompt_ids, prompt_mask, max_new_tokens)
        full = max_new_tokens is None
        sampling = self.sampling if full else self.sampling.with_max_new_tokens(max_new_tokens)
        return self.generator.generate(prompt_ids, prompt_mask, sampling, self.policy_version)

    @property
    def policy_version(self) -> int:
        """The policy version generation samples from: the optimizer step, or in async GRPO the
        version last sent to the server."""
        return self.async_rounds.version if self.async_rounds else self.state.global_step

    # ---- Loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss: one pass, or under token_budget one per run of rows, all but the last
        pass's backward taken here (the Trainer takes the last's; the loss returned is their sum)."""
        values, loss = [], None
        for part in passes.policy_passes(inputs, self.args.pad_to_multiple_of):
            if loss is not None and loss.requires_grad:
                self.accelerator.backward(loss / self.current_gradient_accumulation_steps)  # as the Trainer's
            part_loss, part_values = self._pass_loss(model, part)
            loss = part_loss if loss is None else part_loss + loss.detach()
            values.append(part_values)
        self._record_loss_metrics(values)
        return (loss, None) if return_outputs else loss

    def _record_loss_metrics(self, values: list[tuple[dict, dict, float]]) -> None:
        """Record a micro-step's loss metrics from its passes' (`metrics.loss_values` each)."""
        once, means, tokens = training_metrics.combined_pass_values(values)
        self.record(once)
        if "kl" in means and self.model.training:
            self.kl_control.observe(means["kl"])
        self.record_token_means(means, tokens)

    def _pass_loss(self, model, inputs: dict) -> tuple[Tensor, tuple[dict, dict, float]]:
        """One pass's loss and its metric values (`metrics.loss_values`)."""
        with self.router_aux.recording() as routed:  # MoE router logits, when their loss is on
            logps, entropy, kept = self.completion_logps(model, inputs, with_entropy=True)  # (B, C) each
        old = inputs["old_logps"] if "old_logps" in inputs else logps.detach()  # (B, C) pi_old
        inputs = inputs if "old_logps" in inputs else on_policy_support(inputs, kept)  # on its support
        gather = functools.partial(gather_ragged, self.accelerator)
        weights = policy_weights(self.loss_settings, logps, entropy, old, inputs, gather)
        loss, metrics = grpo_loss(
            logps,
            inputs.get("old_logps"),
            inputs.get("ref_logps"),
            inputs["advantages"],
            inputs["completion_mask"],
            self.loss_settings,
            beta=self.beta,
            entropy=entropy,
            entropy_coef=self.entropy_control.applied(),
            dapo_normalizer=inputs["dapo_normalizer"],
            batch_rows=inputs.get("batch_rows"),  # a token_budget pass: the micro-batch's
            batch_tokens=inputs.get("batch_tokens"),
            **weights,
        )
        loss = self.router_aux.added_to(loss, routed, inputs, metrics)
        if self.model.training:
            self.entropy_control.observe(entropy, inputs["completion_mask"], weights["entropy_mask"])
        return loss, training_metrics.loss_values(metrics, old, inputs, weights["sampler_weights"])

    get_off_policy_mask = staticmethod(masks.get_off_policy_mask)  # TRL's (B, 1) sequence mask

    def get_high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        """TRL's: (B, T) bool, loss tokens at or above the `threshold` entropy quantile over every process."""
        gather = functools.partial(gather_ragged, self.accelerator)
        return masks.get_high_entropy_mask(entropies, mask, threshold, gather)

    @property
    def beta(self) -> float:
        """TRL's: the KL coefficient now (target_kl: the controller's, `training.kl_control`)."""
        return self.kl_control.beta

    @property
    def entropy_coef(self) -> float:
        """TRL's: the entropy coefficient now (use_adaptive_entropy: the controller's, even if unapplied)."""
        return self.entropy_control.coef

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs).detach()
        return loss, None, None

    # ---- Metrics ------------------------------------------------------------------------------

    def record(self, values: dict[str, float]) -> None:
        """Add metric values to the current logging interval (see `metrics.IntervalMetrics`)."""
        self.metrics.record("train" if self.model.training else "eval", values)

    def record_token_means(self, means: dict[str, float], tokens: float) -> None:
        """Add per-token means over `tokens` active tokens, logged as means over every token."""
        self.metrics.record_token_means("train" if self.model.training else "eval", means, tokens)

    def _record_round(self, scored: ScoredRound, all_rewards, aggregated, all_advantages) -> None:
        values = round_metrics(
            scored, all_rewards, aggregated, all_advantages, self.reward_weights, self.reward_func_names,
            self.group_size, self.accelerator,
        )  # fmt: skip
        tokens = values.pop("tokens")
        if self.model.training:
            self.state.num_input_tokens_seen += int(tokens)
        self.record(values | {"num_tokens": self.state.num_input_tokens_seen, "beta": self.beta})

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Evaluate as the Trainer does; each of a dict of eval datasets logs its GRPO metrics under
        its own prefix too (eval_<name>_reward, ...), as it does its loss."""
        self._eval_prefix = metric_key_prefix
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the interval's GRPO metrics (`metrics.IntervalMetrics.reduce`), then log as usual."""
        mode = "train" if self.model.training else "eval"
        prefix = f"{self._eval_prefix}_" if mode == "eval" else ""
        logs.update({prefix + k: v for k, v in self.metrics.reduce(mode, self.accelerator).items()})
        super().log(logs, start_time)
        if self.is_world_process_zero():
            self.completion_log.flush(self.state.global_step)

    # ---- Checkpoints --------------------------------------------------------------------------

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: Tags = None
    ) -> None:
        """TRL's: README.md in output_dir (`training.model_card`); push_to_hub calls it."""
        self.model_card.write(self.args.output_dir, model_name, dataset_name, tags)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save as the Trainer does, then the model card beside the weights (save_model, checkpoints)."""
        super()._save(output_dir, state_dict)
        self.model_card.write(output_dir or self.args.output_dir)

    def _save_checkpoint(self, model, trial):
        """The model card in output_dir (as TRL: the Trainer may push that folder), then save as the
        Trainer does, then the GRPO state (the completion marker), then rotate."""
        self.create_model_card()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # no rotation before this checkpoint is complete
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial)
        folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        round_rest = self._buffer if self._micro_step % self.round_length else None
        if self.async_rounds:
            self.async_rounds.save(folder)
        complete_checkpoint(
            folder, self.accelerator, grpo_state(self) if self.args.should_save else None, round_rest
        )
        if self.args.should_save:
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Train; when resuming, restore the GRPO state and the position in the generation round.

        `resume_from_checkpoint=True` takes the newest complete checkpoint in output_dir.
        """
        resume_from_checkpoint = checkpoint_to_resume(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint:
            state, self._micro_step, self._buffer = read_checkpoint(
                resume_from_checkpoint,
                self.accelerator,
                self.args.gradient_accumulation_steps,
                self.round_length,
            )
            load_grpo_state(self, state)
            if self.async_rounds:
                self.async_rounds.load(resume_from_checkpoint)
        with self.interrupt.catching_signals(), stopping(self.async_rounds), self.generator.around_training():
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.18's `AsyncGRPOTrainer`: `GRPOTrainer` (the same loop) for async GRPO, taking TRL's arguments
    in TRL's order (model, reward_funcs, args, train_dataset, processing_class, callbacks, optimizers,
    tools, environment_factory), then GRPOTrainer's by name; args default to an `AsyncGRPOConfig`
    and must have max_staleness >= 1 (README, 'Async GRPO')."""

    def __init__(self, *positional: object, **named: object):
        super().__init__(**trl_async_arguments(positional, named))
