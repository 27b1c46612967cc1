"""Every correction mode trains with forced staleness and logs finite, consistent statistics."""

import math

import pytest
import torch

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, letter_reward, text_dataset

IS_KEYS = ("ratio_mean", "ratio_min", "ratio_max", "ess", "truncated_frac", "masked_frac", "kl_behaviour")


@pytest.mark.parametrize(
    "mode,bypass",
    [("decoupled", False), ("tis", False), ("mask", False), ("seq_tis", False), ("seq_mask", False), ("tis", True)],
)
def test_modes_with_forced_staleness(tmp_path, tiny_model_dir, mode, bypass):
    # weights reach the workers only every 3 steps, so steps 1 and 2 consume version-0 samples: staleness 1 and 2
    args = async_args(
        tmp_path,
        max_steps=4,
        max_staleness=2,
        weight_sync_steps=3,
        off_policy_correction=mode,
        off_policy_bypass=bypass,
    )
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    assert len(logs) == 4 and max(h["async/staleness_max"] for h in logs) >= 1  # the correction had work to do
    for h in logs:
        assert sum(h[f"async/staleness_k{k}"] for k in range(3)) == 8  # histogram covers every sample
        stats = {k: h[f"is/{k}"] for k in IS_KEYS}
        assert all(math.isfinite(v) for v in stats.values()), stats
        assert stats["ratio_min"] <= stats["ratio_mean"] <= stats["ratio_max"]
        assert 0.0 <= stats["ess"] <= 1.0 + 1e-9 and stats["kl_behaviour"] >= -1e-6
        if h["async/staleness_max"] == 0 or bypass:  # same weights and distribution (or pi_prox := mu): rho = 1
            assert stats["ratio_min"] == pytest.approx(1.0, abs=1e-4) and stats["ratio_max"] == pytest.approx(
                1.0, abs=1e-4
            )
            assert stats["ess"] == pytest.approx(1.0, abs=1e-6) and stats["masked_frac"] == 0.0
    stale = [h for h in logs if h["async/staleness_max"] >= 1]
    if not bypass:  # learning moved the policy, so stale samples have rho != 1
        assert any(h["is/ratio_max"] - h["is/ratio_min"] > 1e-3 for h in stale)


@pytest.mark.parametrize("steps_per_generation", [1, 2])
@pytest.mark.parametrize("mode", ["none", "decoupled"])
def test_correction_adds_no_forward_pass_to_grpo_trainers_own(tmp_path, tiny_model_dir, mode, steps_per_generation):
    """On stale batches (weights reach the workers every 3 steps), pi_prox is a forward GRPOTrainer runs anyway: the
    loss's own (one optimizer step per generation batch) or its old-log-prob pass (several steps per batch, in chunks
    of per_device_train_batch_size). Neither 'none' nor 'decoupled' may add one; 'none' logs no weights."""
    args = async_args(tmp_path, max_steps=4, max_staleness=3, weight_sync_steps=3, off_policy_correction=mode,
                      steps_per_generation=steps_per_generation, per_device_train_batch_size=4)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args,
                               train_dataset=text_dataset())  # fmt: skip
    forwards = []
    trainer.model.register_forward_pre_hook(lambda module, inputs: forwards.append(torch.is_grad_enabled()))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    assert max(h["async/staleness_max"] for h in logs) >= 1  # stale samples were trained on
    steps = trainer.state.global_step
    assert forwards.count(True) == steps  # the loss forward
    batches = steps // steps_per_generation
    old_logp_chunks = 0 if steps_per_generation == 1 else 8 // 4  # a batch of 8 rows, chunks of 4
    assert forwards.count(False) == batches * old_logp_chunks
    assert any("is/ess" in h for h in trainer.state.log_history) == (mode != "none")
