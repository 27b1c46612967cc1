import pytest
from trl import GRPOConfig

from trl_async import AsyncGRPOConfig
from trl_async.config import AsyncFields, resolve_settings

BASE = dict(output_dir="/tmp/trl_async_cfg", report_to=[], bf16=False, use_cpu=True)


@pytest.mark.parametrize(
    "field,value,fix",
    [
        ("max_staleness", -1, "0 \\(synchronous"),
        ("num_rollout_workers", 0, "1 or more"),
        ("rollout_backend", "sglang", "transformers"),
        ("rollout_vllm_weight_transport", "tcp", "nccl"),
        ("rollout_vllm_max_requests", 0, "1 or more"),
        ("rollout_device", "tpu-ish", "torch device"),
        ("rollout_batch_groups", 0, "1 or more"),
        ("rollout_queue_size", 0, "1 or more"),
        ("rollout_weight_update", "sometimes", "batch"),
        ("rollout_timeout_s", 0, "positive"),
        ("off_policy_correction", "magic", "decoupled"),
        ("importance_sampling_cap", 1.0, "cap > 1"),
        ("importance_sampling_floor", 1.0, "floor in \\[0, 1\\)"),
        ("rollout_torch_threads", 0, "1 or more"),
        ("rollout_nice", 20, "from 0 .* to 19"),
        ("rollout_dtype", "int8", "bfloat16"),
        ("rollout_max_restarts", -1, "0 or more"),
        ("rollout_heartbeat_timeout_s", 1.0, "2 seconds or more"),
        ("rollout_scoring_threads", 0, "1 or more"),
        ("dynamic_sampling", "yes", "True or False"),
        ("dynamic_sampling_limit", 0, "generation batches >= 1, or None"),
        ("rollout_consumption_window", 0, "whole number of groups >= 1"),
        ("rollout_consumption_window", True, "whole number of groups >= 1"),
        ("rollout_vllm_down_limit_s", 0, "positive number of seconds, or None"),
        ("rollout_vllm_adapter_dir", 3, "directory path the vLLM servers can read"),
    ],
)
def test_bad_value_names_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ValueError, match=rf"AsyncGRPOConfig\.{field}=.*{fix}"):
        AsyncGRPOConfig(**BASE, **{field: value})


def test_weight_sync_must_fit_in_the_staleness_bound():
    # syncing every 3 steps with max_staleness=1: at step 2 the newest weights are version 0, lag 2 > 1: deadlock
    with pytest.raises(ValueError, match="weight_sync_steps <= 2"):
        AsyncGRPOConfig(**BASE, max_staleness=1, weight_sync_steps=3)
    assert AsyncGRPOConfig(**BASE, max_staleness=2, weight_sync_steps=3).weight_sync_steps == 3


def test_plain_grpo_config_gets_async_defaults():
    settings = resolve_settings(GRPOConfig(**BASE))
    # the defaults, resolved: the engine (use_vllm=False: transformers workers), the correction (loss_type="dapo")
    # and the weight update point (static batches: between generate calls)
    assert settings == AsyncFields(
        rollout_backend="transformers", off_policy_correction="decoupled", rollout_weight_update="batch"
    )
    assert settings.max_staleness == 1 and settings.off_policy_correction == "decoupled"
    assert settings.resolved_importance_sampling_cap == 5.0  # AReaL's cap for the decoupled default


def test_vespo_gets_truncation_by_default_and_refuses_weights_that_do_not_compose():
    assert AsyncGRPOConfig(**BASE, loss_type="vespo").off_policy_correction == "tis"
    assert resolve_settings(GRPOConfig(**BASE, loss_type="vespo")).off_policy_correction == "tis"
    assert AsyncGRPOConfig(**BASE, loss_type="vespo", off_policy_correction="none").off_policy_correction == "none"
    for mode in ("decoupled", "mask", "seq_tis", "seq_mask"):
        with pytest.raises(ValueError, match=rf"off_policy_correction='{mode}' is invalid: with loss_type='vespo' use "
                                             "'tis'.*silence its whole sequence"):  # fmt: skip
            AsyncGRPOConfig(**BASE, loss_type="vespo", off_policy_correction=mode)
    assert AsyncGRPOConfig(**BASE, loss_type="grpo").off_policy_correction == "decoupled"


def test_caps_default_by_mode_and_none_warns_when_stale():
    assert AsyncGRPOConfig(**BASE, off_policy_correction="tis").resolved_importance_sampling_cap == 2.0
    assert AsyncGRPOConfig(**BASE, importance_sampling_cap=3.0).resolved_importance_sampling_cap == 3.0
    with pytest.warns(UserWarning, match="ablations"):
        AsyncGRPOConfig(**BASE, off_policy_correction="none", max_staleness=2)


def test_async_config_is_a_grpo_config_with_its_values():
    cfg = AsyncGRPOConfig(**BASE, max_staleness=3, num_rollout_workers=2)
    assert isinstance(cfg, GRPOConfig)
    assert resolve_settings(cfg).max_staleness == 3 and resolve_settings(cfg).num_rollout_workers == 2


def test_paged_engine_settings_that_would_break_mu_or_the_swap_are_refused_where_they_would_be_used():
    cb = dict(use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match=r"transformers_continuous_batching_config=.*allow_block_sharing=True cannot"):
        AsyncGRPOConfig(**BASE, **cb, transformers_continuous_batching_config={"allow_block_sharing": True})
    with pytest.raises(
        ValueError, match=r"transformers_continuous_batching_config=.*ContinuousBatchingConfig refuses"
    ):
        AsyncGRPOConfig(**BASE, **cb, transformers_continuous_batching_config={"slots": 8})
    given = {"scheduler_type": "prefill_first", "num_blocks": 64}
    assert AsyncGRPOConfig(
        **BASE, **cb, transformers_continuous_batching_config=given
    ).use_transformers_continuous_batching
    # GRPOTrainer reads the settings only with continuous batching on, and never with vLLM: neither do the workers
    off = {"allow_block_sharing": True}
    assert not AsyncGRPOConfig(
        **BASE, transformers_continuous_batching_config=off
    ).use_transformers_continuous_batching
    AsyncGRPOConfig(**BASE, **cb, rollout_backend="vllm", transformers_continuous_batching_config=off)


def test_the_older_use_transformers_paged_turns_continuous_batching_on_as_in_trl():
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        config = AsyncGRPOConfig(**BASE, use_transformers_paged=True)
    assert config.use_transformers_continuous_batching


def test_weight_update_point_defaults_to_the_backends_cheap_one():
    assert AsyncGRPOConfig(**BASE).resolved_weight_update == "batch"  # workers adopt between generate calls
    assert AsyncGRPOConfig(**BASE, rollout_backend="vllm").resolved_weight_update == "decode_step"  # pause keep
    assert (
        AsyncGRPOConfig(**BASE, rollout_backend="vllm", rollout_weight_update="batch").resolved_weight_update
        == "batch"
    )
    assert AsyncGRPOConfig(**BASE, use_vllm=True, vllm_mode="server").resolved_weight_update == "decode_step"
    continuous = AsyncGRPOConfig(**BASE, use_transformers_continuous_batching=True)  # rows in flight re-encoded
    assert continuous.resolved_weight_update == "decode_step"
    # resolved once, into the settings every part reads; a plain GRPOConfig's continuous batching counts too
    assert resolve_settings(continuous).rollout_weight_update == "decode_step"
    assert resolve_settings(AsyncGRPOConfig(**BASE)).rollout_weight_update == "batch"
    assert resolve_settings(GRPOConfig(**BASE, use_transformers_continuous_batching=True)).rollout_weight_update == (
        "decode_step"
    )
    given = AsyncGRPOConfig(**BASE, use_transformers_continuous_batching=True, rollout_weight_update="batch")
    assert resolve_settings(given).rollout_weight_update == "batch"


def test_rollout_threads_default_to_the_cores_shared_among_workers(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert AsyncGRPOConfig(**BASE).resolved_rollout_threads == 5
    assert AsyncGRPOConfig(**BASE, num_rollout_workers=2).resolved_rollout_threads == 2
    assert AsyncGRPOConfig(**BASE, num_rollout_workers=8).resolved_rollout_threads == 1
    assert AsyncGRPOConfig(**BASE, rollout_torch_threads=3).resolved_rollout_threads == 3


def test_rollout_workers_on_the_cpu_get_the_lowest_priority_by_default():
    assert AsyncGRPOConfig(**BASE).resolved_rollout_nice == 19
    assert AsyncGRPOConfig(**BASE, rollout_nice=5).resolved_rollout_nice == 5
    assert AsyncFields(rollout_device="cuda:1").resolved_rollout_nice == 0  # GPU workers need their launch thread


def test_workers_generate_in_the_dtype_the_trainer_computes_in_where_it_is_native():
    import torch

    from trl_async.hardware.precision import NativePrecision

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    amx, avx2 = NativePrecision(True, True, "AMX"), NativePrecision(False, False, "AVX2 only")
    fields = AsyncFields()
    assert fields.resolved_rollout_dtype(f32, True, False, amx) == bf16  # autocast: matmuls in bf16
    assert fields.resolved_rollout_dtype(f32, False, True, amx) == f16
    assert fields.resolved_rollout_dtype(f32, False, False, amx) == f32
    assert fields.resolved_rollout_dtype(bf16, True, False, amx) == bf16  # bf16 weights stay bf16
    # where bf16/fp16 would be emulated (26x slower on an AVX2-only CPU), the weights' dtype
    assert fields.resolved_rollout_dtype(f32, True, False, avx2) == f32
    assert fields.resolved_rollout_dtype(f32, False, True, avx2) == f32
    assert fields.resolved_rollout_dtype(f32, True, False, NativePrecision(False, True, "fp16 only")) == f32
    assert fields.resolved_rollout_dtype(bf16, True, False, avx2) == bf16  # bf16 weights are the user's choice
    assert AsyncFields(rollout_verify_weights=True).resolved_rollout_dtype(f32, True, False, amx) == f32  # bit for bit
    assert AsyncFields(rollout_dtype="float32").resolved_rollout_dtype(f32, True, False, amx) == f32
    assert AsyncFields(rollout_dtype="bfloat16").resolved_rollout_dtype(f32, True, False, avx2) == bf16  # explicit


def test_rollout_dtype_is_for_transformers_workers_without_weight_hashing():
    assert AsyncGRPOConfig(**BASE, rollout_dtype="bfloat16").rollout_dtype == "bfloat16"
    with pytest.raises(ValueError, match="rollout_dtype=.*vLLM server's dtype"):
        AsyncGRPOConfig(**BASE, rollout_dtype="bfloat16", rollout_backend="vllm")
    with pytest.raises(ValueError, match="rollout_verify_weights=True.*cannot reproduce"):
        AsyncGRPOConfig(**BASE, rollout_dtype="bfloat16", rollout_verify_weights=True)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"num_return_sequences": 2}, "num_return_sequences=2 .* wrong prompts.*num_generations"),
        ({"prompt_lookup_num_tokens": 3}, "assisted_generation decoding"),
        ({"num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 0.5}, "group_beam_search decoding"),
        ({"dola_layers": "low"}, "dola_generation decoding"),
    ],
)
def test_generation_kwargs_the_workers_cannot_sample_with_are_refused_with_the_reason(kwargs, reason):
    """Found by running each with GRPOTrainer and AsyncGRPOTrainer on a tiny model: num_return_sequences trained
    silently with completions paired to the wrong prompts; prompt lookup and group beam search crashed the worker."""
    with pytest.raises(ValueError, match="generation_kwargs.*" + reason):
        AsyncGRPOConfig(output_dir="x", generation_kwargs=kwargs, bf16=False, use_cpu=True)
    for fine in ({"do_sample": False}, {"num_beams": 2}, {"guidance_scale": 1.5}, {"no_repeat_ngram_size": 2}):
        # (the last two reshape the distribution in ways the ratio does not rebuild: allowed without a correction)
        AsyncGRPOConfig(output_dir="x", generation_kwargs=fine, off_policy_correction="none", bf16=False, use_cpu=True)


@pytest.mark.parametrize("kwargs", [{"num_return_sequences": 2}, {"do_sample": False, "penalty_alpha": 0.6}])
def test_the_generation_config_the_workers_get_is_checked_whatever_config_class_and_top_k_built_it(kwargs):
    """A plain GRPOConfig carries no async validation, and top_k (a GRPOConfig field) turns penalty_alpha into
    contrastive search: the check reads the GenerationConfig GRPOTrainer builds from both."""
    from transformers import GenerationConfig

    from trl_async.correction.generation_modes import refused_generation

    built = GenerationConfig(**{"max_new_tokens": 4, "do_sample": True, "top_k": 4, **kwargs})  # as GRPOTrainer does
    assert refused_generation(built) is not None
    assert refused_generation(GenerationConfig(max_new_tokens=4, do_sample=True, top_k=4)) is None
    with pytest.raises(ValueError, match="generation_kwargs.*(contrastive_search|num_return_sequences=2)"):
        AsyncGRPOConfig(output_dir="x", generation_kwargs=kwargs, top_k=4, bf16=False, use_cpu=True)


def test_vllm_n_in_generation_kwargs_is_refused_as_it_would_replace_num_generations():
    with pytest.raises(ValueError, match="generation_kwargs.*'n'.*num_generations"):
        AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", generation_kwargs={"n": 3}, bf16=False, use_cpu=True)
    AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", generation_kwargs={"seed": 3}, bf16=False, use_cpu=True)


def test_every_async_field_has_a_rule():
    from dataclasses import fields

    from trl_async.config.checks import FIELD_RULES

    ruled = [name for name, _, _ in FIELD_RULES]
    assert len(ruled) == len(set(ruled))
    unruled = {f.name for f in fields(AsyncFields) if f.init} - set(ruled)
    assert unruled == {"rollout_cpu_affinity"}  # checked against this process's cores, by its own rule


@pytest.mark.parametrize(
    "field,value",
    [("off_policy_bypass", "yes"), ("rollout_verify_weights", 1), ("rollout_vllm_server_args", "--enforce-eager"),
     ("rollout_trajectory_file", 3), ("rollout_vllm_python", ["python"]), ("num_rollout_workers", True),
     ("rollout_max_restarts", 1.5), ("rollout_timeout_s", "60")],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"AsyncGRPOConfig\.{field}="):
        AsyncGRPOConfig(**BASE, **{field: value})


def test_trl_parser_prints_help_and_offers_the_allowed_values():
    # argparse formats help strings with %: a bare % in one would crash `--help` of every TrlParser script
    from trl import TrlParser

    text = TrlParser((AsyncGRPOConfig,)).format_help()
    assert "--rollout_lora_sync {adapters,merged}" in text
    assert "--rollout_dtype {float32,bfloat16,float16}" in text
    assert "--off_policy_correction {decoupled,tis,mask,seq_tis,seq_mask,none}" in text


def test_every_async_field_is_in_one_group_and_the_configuration_page_is_current():
    from dataclasses import fields
    from pathlib import Path

    from trl_async.config import reference

    grouped = [name for names in reference.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in fields(AsyncFields) if f.init)
    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == reference.markdown(), "regenerate: python -m trl_async.config.reference > " + str(page)
    assert "    > The three dials" in AsyncGRPOConfig.__doc__ and "rollout_lora_sync (`" in AsyncGRPOConfig.__doc__


def test_a_deepspeed_run_without_deepspeed_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r'pip install deepspeed \(or `pip install -e "\.\[deepspeed\]"`'):
        AsyncGRPOConfig(**BASE, deepspeed={"zero_optimization": {"stage": 2}})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # accelerate launch with a DeepSpeed config
    with pytest.raises(ImportError, match=r"pip install deepspeed"):
        AsyncGRPOConfig(**BASE)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    assert AsyncGRPOConfig(**BASE).max_staleness == 1  # not a DeepSpeed run: nothing needed


def test_a_runs_settings_are_resolved_once_and_read_only_while_the_config_keeps_what_was_given():
    cfg = AsyncGRPOConfig(**BASE)
    settings = resolve_settings(cfg)
    assert cfg.rollout_backend is None and settings.rollout_backend == "transformers"  # follows use_vllm, on read
    with pytest.raises(AttributeError, match="read-only: max_staleness cannot change"):
        settings.max_staleness = 5
    cfg.max_staleness = 2  # the config stays an editable dataclass, as GRPOConfig is
    assert resolve_settings(cfg).max_staleness == 2 and settings.max_staleness == 1
