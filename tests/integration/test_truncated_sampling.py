"""At staleness 0 the importance ratio is 1 whatever the sampler: the trainer rebuilds the distribution the engine
sampled from (temperature, top-k, top-p, min-p, repetition penalty, and on the transformers workers the other
warpers) before comparing it with mu. Without that, each token's ratio is the probability mass the sampler kept."""

from __future__ import annotations

import pytest

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer

from ..conftest import async_args, letter_reward, text_dataset, trained_staleness

COMBINATION = dict(temperature=0.7, top_p=0.8, top_k=12, min_p=0.05, repetition_penalty=1.3)


def ratio_stats(trainer) -> list[tuple[float, float, float]]:
    return [(h["is/ratio_min"], h["is/ratio_mean"], h["is/ratio_max"])
            for h in trainer.state.log_history if "is/ratio_mean" in h]  # fmt: skip


def assert_ratios_are_one(trainer, tol: float) -> None:
    stats = ratio_stats(trainer)
    assert stats and all(1 - tol < low and high < 1 + tol for low, _, high in stats), stats


@pytest.mark.parametrize(
    "sampler",
    [
        dict(top_p=0.7),
        dict(top_k=8),
        dict(min_p=0.3),
        dict(repetition_penalty=1.5),
        dict(generation_kwargs={"typical_p": 0.8, "epsilon_cutoff": 0.02}),
        dict(generation_kwargs={"min_new_tokens": 4}),
        dict(generation_kwargs={"temperature": 0.7}),  # the engine's temperature, not the loss's
        dict(temperature=0.7, repetition_penalty=1.3, generation_kwargs={"do_sample": False, "min_new_tokens": 3}),
        COMBINATION,
    ],
    ids=[
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "typical_epsilon",
        "min_new_tokens",
        "kwargs_temperature",
        "greedy",
        "combination",
    ],
)
def test_transformers_workers_ratio_is_one_at_staleness_0(tmp_path, tiny_model_dir, sampler):
    args = async_args(tmp_path, max_staleness=0, max_steps=3, max_completion_length=10, **sampler)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args,
                               train_dataset=text_dataset())  # fmt: skip
    trainer.train()
    assert trained_staleness(trainer) == [0.0] * 3
    assert_ratios_are_one(trainer, tol=1e-3)  # every token, not only on average


def test_each_of_several_prompt_lengths_is_penalised_without_its_padding(tmp_path, tiny_model_dir):
    """Prompts of different lengths share a worker's batch, left-padded; a pad token counted as seen would change
    the penalised distribution of the shorter prompts' rows only."""
    from datasets import Dataset

    prompts = [{"prompt": "a" * n, "letter": "m"} for n in (1, 7, 2, 9, 3, 5, 4, 8)]
    args = async_args(tmp_path, max_staleness=0, max_steps=2, max_completion_length=10, repetition_penalty=3.0,
                      rollout_batch_groups=2, num_rollout_workers=1)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args,
                               train_dataset=Dataset.from_list(prompts))  # fmt: skip
    trainer.train()
    assert_ratios_are_one(trainer, tol=1e-3)


def test_vllm_greedy_is_refused_as_vllm_refuses_it_with_several_completions():
    with pytest.raises(ValueError, match="generation_kwargs.*greedily.*num_generations"):
        AsyncGRPOConfig(output_dir="x", rollout_backend="vllm", rollout_vllm_urls=["http://x:1"],
                        generation_kwargs={"temperature": 0.0}, use_cpu=True, bf16=False)  # fmt: skip


def test_truncation_with_the_bypass_is_refused():
    with pytest.raises(ValueError, match="off_policy_bypass"):
        AsyncGRPOConfig(output_dir="x", top_p=0.9, off_policy_bypass=True, use_cpu=True, bf16=False)


@pytest.mark.parametrize("kwargs", [{"no_repeat_ngram_size": 2}, {"min_length": 3}])
def test_a_distribution_change_the_ratio_cannot_rebuild_is_refused_while_correcting(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AsyncGRPOConfig(output_dir="x", generation_kwargs=kwargs, use_cpu=True, bf16=False)
    AsyncGRPOConfig(output_dir="x", generation_kwargs=kwargs, off_policy_correction="none", use_cpu=True, bf16=False)


@pytest.mark.vllm
def test_vllm_server_ratio_is_one_at_staleness_0(tmp_path, vllm_server, vllm_model_dir):
    from ..vllm.test_vllm_backend import _dataset, _reward, _vllm_args

    for sampler in (dict(top_p=0.7), dict(top_k=8), dict(min_p=0.3), dict(repetition_penalty=1.5),
                    dict(generation_kwargs={"min_tokens": 4, "stop_token_ids": [5]}),  # EOS held back too
                    dict(generation_kwargs={"temperature": 0.7}),  # the engine's temperature, not the loss's
                    COMBINATION):  # fmt: skip
        args = _vllm_args(tmp_path, vllm_server.url, max_staleness=0, max_steps=2, **sampler)
        trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset())
        trainer.train()
        assert trainer.state.global_step == 2
        assert_ratios_are_one(trainer, tol=1e-3)
