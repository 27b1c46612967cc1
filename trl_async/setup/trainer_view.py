"""The trainer as the layers below it see it: the one place that reads an ``AsyncGRPOTrainer``'s attributes for
them, GRPOTrainer's private ones included, so that a TRL release renaming one fails here, at set-up, by name.
``pool.py`` builds the pool from ``PoolInputs`` alone, ``checks.py`` checks ``Loaded``. A user's ``rollout_func``
gets the trainer itself (TRL's contract), through ``RolloutFuncTrainerView`` on a background thread; outside a
background rollout (evaluation) it samples with the trainer's own model (``generate_with_trainer_model``, which sets
the trainer's generation config for the length of one call)."""

from __future__ import annotations

import copy
import functools
import math

from ..rollout.grpo_private import generate_single_turn
from .checks import Loaded
from .pool import PoolInputs, SamplingInputs


def loaded(trainer) -> Loaded:
    """What GRPOTrainer has set up, for the checks after loading."""
    return Loaded(
        args=trainer.args,
        async_args=trainer.async_args,
        model=trainer.accelerator.unwrap_model(trainer.model),
        device=trainer.accelerator.device,
        tokenizer=trainer._tokenizer,
        generation_config=trainer.generation_config,
        train_dataset=trainer.train_dataset,
        tools=list(trainer.tools or []),
        num_iterations=trainer.num_iterations,
        is_vlm=trainer._is_vlm,
        episodes=trainer.environment_factories is not None or trainer.rollout_func is not None,
    )


def sampling_inputs(trainer) -> SamplingInputs:
    """GRPOTrainer's sampling settings, as set at construction."""
    return SamplingInputs(
        backend=trainer.async_args.rollout_backend,
        num_generations=trainer.num_generations,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        repetition_penalty=trainer.repetition_penalty,
        max_completion_length=trainer.max_completion_length,
        eos_token_ids=tuple(trainer.eos_token_ids),
        generation_kwargs=dict(trainer.args.generation_kwargs or {}),
        generation_config=trainer.generation_config,
    )


def pool_inputs(trainer) -> PoolInputs:
    """The trainer's settings and collaborators for a pool started now (its version is the current step)."""
    environments = trainer.environment_factories is not None  # GRPOTrainer sets these three for environments only
    return PoolInputs(
        args=trainer.args,
        async_args=trainer.async_args,
        geometry=trainer._geometry,
        sampling=sampling_inputs(trainer),
        model=trainer.accelerator.unwrap_model(trainer.model),
        device=trainer.accelerator.device,
        start_version=trainer.state.global_step,
        core_split=trainer._core_split,
        adapter_sync=trainer._adapter_sync,
        colocated_gpus=trainer._colocated_gpus,
        train_dataset=trainer.train_dataset,
        shuffle_dataset=trainer.shuffle_dataset,
        processing_class=trainer.processing_class,
        tokenizer=trainer._tokenizer,
        chat_template=trainer.chat_template,
        chat_template_kwargs=dict(trainer.chat_template_kwargs or {}),
        tools=list(trainer.tools or []),
        environment_factories=trainer.environment_factories,
        standalone_tools=list(trainer._standalone_tools) if environments else [],
        env_tools=dict(trainer._env_tools) if environments else {},
        multi_environment=trainer._multi_environment if environments else False,
        max_tool_calling_iterations=trainer.max_tool_calling_iterations,
        rollout_func=trainer.rollout_func,
        rollout_func_view=functools.partial(RolloutFuncTrainerView, trainer),
        event_loop=getattr(trainer, "async_loop", None),
        reward_funcs=trainer._scoring_reward_funcs,
        reward_processing_classes=trainer.reward_processing_classes,
        reward_func_names=trainer.reward_func_names,
        reward_weights=trainer.reward_weights,
        trainer_state=lambda: trainer.state,
    )


class RolloutFuncTrainerView:
    """What ``rollout_func`` receives as ``trainer`` on a background thread: the trainer's attributes, read-only, but
    its own tokenizer copy and ``rollout_generate`` bound to this thread's rollout (``generate``)."""

    def __init__(self, trainer, generate, tokenizer) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "rollout_generate", generate)  # the rollout's own threads may sample through it too
        object.__setattr__(self, "processing_class", tokenizer)
        object.__setattr__(self, "_tokenizer", getattr(tokenizer, "tokenizer", tokenizer))  # a processor's tokenizer

    def __getattr__(self, name):
        return getattr(self._trainer, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"rollout_func may not set trainer.{name}: it runs beside training, on another thread")


def generate_with_trainer_model(trainer, prompt_ids, max_new_tokens: int | None) -> dict:
    """``rollout_generate`` outside a background rollout (evaluation: on the main thread or the rollout's own threads,
    one call at a time): GRPOTrainer's own generation with the trainer's model, as its evaluation would sample (no
    log-probs: NaN)."""
    shared = trainer.generation_config  # also the rollout workers' (their specs hold it): never changed here
    if max_new_tokens is not None:
        trainer.generation_config = copy.deepcopy(shared)
        trainer.generation_config.max_new_tokens = max_new_tokens
    try:
        completion_ids = generate_single_turn(trainer, prompt_ids)
    finally:
        trainer.generation_config = shared
    completion_ids = [list(c) for c in completion_ids]
    return {
        "completion_ids": completion_ids,
        "logprobs": [[math.nan] * len(c) for c in completion_ids],
        "versions": [[trainer.state.global_step] * len(c) for c in completion_ids],
    }
