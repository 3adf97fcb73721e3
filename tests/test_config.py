"""GRPOConfig: every check names the setting to change; derived batch sizes."""

import pytest

from grpo_hf.algorithm.loss import LossSettings
from grpo_hf.algorithm.policy_terms import PolicySettings
from grpo_hf.algorithm.sampler_correction import SamplerCorrection, Truncation
from grpo_hf.config.grpo_config import GRPOConfig


def make(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"num_generations": 1}, ["num_generations"]),
        ({"temperature": 0.0}, ["temperature"]),
        ({"beta": -1.0}, ["beta"]),
        ({"epsilon": 0.0}, ["epsilon"]),
        ({"epsilon_high": -0.1}, ["epsilon_high"]),
        ({"delta": 1.1}, ["delta", "epsilon_high"]),  # must exceed 1 + epsilon_high = 1.2
        ({"target_kl": 0.1, "beta": 0.0}, ["target_kl", "beta"]),
        ({"loss_type": "ppo"}, ["loss_type"]),
        ({"kl_estimator": "k4"}, ["kl_estimator"]),
        ({"scale_rewards": "local"}, ["scale_rewards"]),
        ({"multi_objective_aggregation": "mean"}, ["multi_objective_aggregation"]),
        ({"num_completions_to_print": -1}, ["num_completions_to_print"]),
        ({"log_completions_hub_repo": "me/completions"}, ["log_completions_hub_repo", "log_completions"]),
        ({"importance_sampling_level": "group"}, ["importance_sampling_level"]),
        ({"generation_backend": "tensorrt"}, ["generation_backend"]),
        ({"num_generations_eval": 0}, ["num_generations_eval"]),
        ({"router_aux_loss_coef": -0.1}, ["router_aux_loss_coef"]),
        ({"entropy_coef": -0.1, "use_adaptive_entropy": True}, ["entropy_coef", "use_adaptive_entropy"]),
        ({"model_init_kwargs": "dtype=bfloat16"}, ["model_init_kwargs", "JSON"]),
        ({"auto_find_batch_size": True}, ["auto_find_batch_size", "per_device_train_batch_size"]),
        # async GRPO: generation on a vLLM server, whole rounds in the queue, its own settings only with it
        ({"max_staleness": 1}, ["max_staleness", "use_vllm=True", "vllm_mode='server'"]),
        ({"max_staleness": -1}, ["max_staleness"]),
        ({"weight_sync_steps": 2}, ["weight_sync_steps", "max_staleness"]),
        ({"max_inflight_tasks": 0}, ["max_inflight_tasks"]),
        ({"heartbeat_stale_after_s": 0}, ["heartbeat_stale_after_s"]),
        (
            {"max_staleness": 1, "use_vllm": True, "vllm_mode": "server", "queue_maxsize": 4},
            ["queue_maxsize", "generation_batch_size=8"],
        ),
        # evaluation with fewer completions per prompt: its batch must hold whole groups of those
        (
            {"per_device_eval_batch_size": 4, "num_generations_eval": 3, "eval_strategy": "steps"},
            ["per_device_eval_batch_size", "num_generations_eval"],
        ),
        # 6 completions per round cannot hold whole groups of 4
        (
            {"per_device_train_batch_size": 6, "num_generations": 4},
            ["per_device_train_batch_size", "num_generations"],
        ),
        (
            {"generation_batch_size": 16, "steps_per_generation": 2},
            ["generation_batch_size", "steps_per_generation"],
        ),
        # 12 completions per round is not a whole number of micro-batches of 8
        (
            {"generation_batch_size": 12, "num_generations": 4},
            ["generation_batch_size", "per_device_train_batch_size"],
        ),
        # 3 micro-steps per round cannot make whole optimizer steps of 2 micro-steps
        (
            {
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "steps_per_generation": 3,
                "gradient_accumulation_steps": 2,
            },
            ["steps_per_generation", "gradient_accumulation_steps"],
        ),  # fmt: skip
        # evaluation configured: its batches must hold whole groups too
        (
            {"per_device_eval_batch_size": 6, "num_generations": 4, "eval_strategy": "steps"},
            ["per_device_eval_batch_size", "num_generations"],
        ),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else None,
)
def test_errors_name_the_setting(tmp_path, kwargs, names):
    with pytest.raises(ValueError) as error:
        make(tmp_path, **kwargs)
    for name in names:
        assert name in str(error.value), str(error.value)


def test_defaults(tmp_path):
    config = make(tmp_path)
    assert config.epsilon_high == config.epsilon == 0.2
    assert config.steps_per_generation == config.gradient_accumulation_steps == 1
    assert config.generation_batch_size == 8  # per_device_train_batch_size 8 x 1 process x 1 step
    assert config.loss_type == "dapo" and config.kl_estimator == "k3" and config.scale_rewards == "group"
    assert config.multi_objective_aggregation == "sum_then_normalize"
    assert config.num_completions_to_print is None  # TRL's: print every completion of the table
    assert config.log_multimodal and not config.log_unique_prompts and config.log_completions_hub_repo is None
    assert config.max_staleness == 0 and config.weight_sync_steps == 1  # synchronous training


@pytest.mark.parametrize(
    ("kwargs", "on", "checkpoint_kwargs"),
    [
        ({}, True, None),  # TRL's default: on
        ({"gradient_checkpointing": False}, False, None),  # TRL's name, as the shipped configs write it
        ({"gradient_checkpointing_kwargs": {"use_reentrant": False}}, True, {"use_reentrant": False}),
    ],
)
def test_trls_checkpointing_names_are_taken_without_transformers_deprecation_warning(
    tmp_path, recwarn, kwargs, on, checkpoint_kwargs
):
    config = make(tmp_path, **kwargs)
    assert config.gradient_checkpointing is on and config.gradient_checkpointing_kwargs == checkpoint_kwargs
    if hasattr(config, "activation_checkpointing"):  # transformers >= 5.20 reads the new names
        assert config.activation_checkpointing is on
        assert config.activation_checkpointing_kwargs == checkpoint_kwargs
    assert not [w for w in recwarn if "checkpointing" in str(w.message)]


@pytest.mark.parametrize(
    ("value", "scale"),
    [(True, "group"), (False, "none"), ("True", "group"), ("false", "none"), ("batch", "batch")],
)
def test_scale_rewards_takes_trl_booleans(tmp_path, value, scale):
    assert make(tmp_path, scale_rewards=value).scale_rewards == scale


@pytest.mark.parametrize(("flag", "scale"), [("False", "none"), ("true", "group"), ("none", "none")])
def test_scale_rewards_booleans_from_the_command_line(tmp_path, flag, scale):
    from transformers import HfArgumentParser

    argv = [
        "--output_dir",
        str(tmp_path),
        "--report_to",
        "none",
        "--use_cpu",
        "true",
        "--scale_rewards",
        flag,
    ]
    (config,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(argv)
    assert config.scale_rewards == scale


def test_scale_rewards_other_than_group_warns_with_normalize_then_sum(tmp_path):
    with pytest.warns(UserWarning, match="scale_rewards='batch' has no effect"):
        make(tmp_path, scale_rewards="batch", multi_objective_aggregation="normalize_then_sum")


def test_epsilon_high_follows_epsilon_unless_set(tmp_path):
    assert make(tmp_path, epsilon=0.3).epsilon_high == 0.3
    config = make(tmp_path, epsilon=0.2, epsilon_high=0.28)
    assert (config.epsilon, config.epsilon_high) == (0.2, 0.28)


def test_loss_settings_carry_the_configs_values_typed(tmp_path):
    """The loss gets one typed object built from the config: every value as set, epsilon_high resolved
    to epsilon, the vLLM-less correction from sampler_is_cap, the truncation our decoder applies."""
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], loss_type="grpo", epsilon=0.1,
        delta=2.0, sapo_temperature_neg=0.5, sapo_temperature_pos=0.6, vespo_k_pos=0.7, vespo_lambda_pos=0.8,
        vespo_k_neg=0.9, vespo_lambda_neg=1.1, kl_estimator="k2", use_bias_correction_kl=False,
        importance_sampling_level="sequence", max_completion_length=17, off_policy_mask_threshold=0.3,
        top_entropy_quantile=0.5, sampler_is_cap=2.5, top_k=20, top_p=0.9,
    )  # fmt: skip
    assert args.loss_settings() == LossSettings(
        loss_type="grpo",
        policy=PolicySettings(0.1, 0.1, 2.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.1),
        kl_estimator="k2",
        use_bias_correction_kl=False,
        importance_sampling_level="sequence",
        max_completion_length=17,
        off_policy_mask_threshold=0.3,
        top_entropy_quantile=0.5,
        sampler_correction=SamplerCorrection("token_truncate", None, 2.5),
        sampler_truncation=Truncation(top_k=20, top_p=0.9, min_p=0.0, min_p_first=False),
    )


def test_steps_per_generation_defaults_to_gradient_accumulation(tmp_path):
    config = make(tmp_path, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=3)
    assert config.steps_per_generation == 3
    assert config.generation_batch_size == 12  # 4 x 1 process x 3 steps


def test_generation_batch_size_derives_steps_per_generation(tmp_path):
    config = make(tmp_path, per_device_train_batch_size=4, num_generations=4, generation_batch_size=16)
    assert config.steps_per_generation == 4  # 16 / (4 x 1 process)
    assert config.generation_batch_size == 16


def test_steps_per_generation_derives_generation_batch_size(tmp_path):
    # 6 per micro-step is not a multiple of 4, but 2 steps make 12 = 3 whole groups
    config = make(tmp_path, per_device_train_batch_size=6, num_generations=4, steps_per_generation=2)
    assert config.generation_batch_size == 12


@pytest.mark.parametrize(
    ("steps", "accumulation", "suggested"),
    [
        # A round of 2 micro-steps, steps of 3: step 1 = round 1 + the first half of round 2.
        (2, 3, "1 or 3"),
        # A round of 3, steps of 2: step 2 = the end of round 1 + the start of round 2.
        (3, 2, "2 or 4"),
        # TRL's accepted 4 and 3: step 2 = round 1's last micro-batch + two of round 2's.
        (4, 3, "3 or 6"),
        # A round of 3, steps of 4: step 1 = round 1 + a third of round 2.
        (3, 4, "2 or 4"),
    ],
)
def test_steps_that_would_straddle_rounds_are_refused_naming_both_settings(
    tmp_path, steps, accumulation, suggested
):
    with pytest.raises(ValueError) as error:
        make(
            tmp_path, per_device_train_batch_size=4, num_generations=4, steps_per_generation=steps,
            gradient_accumulation_steps=accumulation,
        )  # fmt: skip
    message = str(error.value)
    assert f"steps_per_generation={steps} and gradient_accumulation_steps={accumulation}" in message
    assert f"set steps_per_generation to {suggested}" in message
    with pytest.raises(ValueError, match="generation_batch_size"):  # the same rule, by generation batch
        make(
            tmp_path, per_device_train_batch_size=4, num_generations=4, generation_batch_size=4 * steps,
            gradient_accumulation_steps=accumulation,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("steps", "accumulation"),
    [
        (4, 2),  # two optimizer steps per round, each on two of its micro-batches
        (2, 4),  # two whole rounds per optimizer step
    ],
)
def test_steps_and_rounds_that_divide_one_another_are_accepted(tmp_path, steps, accumulation):
    config = make(
        tmp_path, per_device_train_batch_size=4, num_generations=4, steps_per_generation=steps,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    assert (config.steps_per_generation, config.generation_batch_size) == (steps, 4 * steps)


def test_num_generations_eval_defaults_to_num_generations(tmp_path):
    assert make(tmp_path, num_generations=4).num_generations_eval == 4
    assert make(tmp_path, num_generations=4, num_generations_eval=1).num_generations_eval == 1


def test_eval_batch_is_not_checked_without_evaluation(tmp_path):
    assert make(tmp_path, per_device_eval_batch_size=6, num_generations=4).per_device_eval_batch_size == 6


def test_an_eval_dataset_checks_the_eval_batch_before_the_model_loads(tmp_path):
    from trainer_helpers import chat_dataset, length_reward

    from grpo_hf import GRPOTrainer

    args = make(tmp_path, per_device_eval_batch_size=6, num_generations=4)
    with pytest.raises(
        ValueError, match="per_device_eval_batch_size"
    ):  # not an error loading "no-such-model"
        GRPOTrainer("no-such-model", length_reward, args=args, eval_dataset=chat_dataset(2))


def test_a_negative_entropy_coef_is_taken_without_adaptive_entropy(tmp_path):
    """An entropy penalty, as TRL allows (its sign is not restricted there)."""
    assert make(tmp_path, entropy_coef=-0.1).entropy_coef == -0.1
