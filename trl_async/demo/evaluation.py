"""Greedy held-out accuracy, logged with the trainer's own evaluation.

GRPOTrainer's ``evaluate`` samples completions (``temperature``, ``num_generations_eval``) and logs their mean reward as
``eval_reward``: a noisy measure of a policy. ``GreedyAccuracyCallback`` adds the number users judge a model by: on
every evaluation, one greedy completion per ``eval_dataset`` prompt from the trainer's current weights, scored by a
reward function (1.0 = correct), logged as ``eval_greedy_accuracy`` beside TRL's eval metrics. Works with
``GRPOTrainer`` and ``AsyncGRPOTrainer`` alike, and under ZeRO-3 (every rank takes part in the gathered generation)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import TrainerCallback
from trl.data_utils import is_conversational
from trl.models import unwrap_model_for_generation


@torch.no_grad()
def greedy_completions(trainer, prompts: list, max_new_tokens: int, batch_size: int = 32) -> list[str]:
    """One greedy completion per prompt (standard or conversational) from ``trainer``'s current weights. Collective
    under ZeRO-3: every rank must call it with the same prompts."""
    tokenizer = trainer.processing_class
    device = trainer.accelerator.device
    completions = []
    args = trainer.args
    with unwrap_model_for_generation(
        trainer.model_wrapped,
        trainer.accelerator,
        gather_deepspeed3_params=args.ds3_gather_for_generation,
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,  # restored as TRL restores them
    ) as model:
        was_training = model.training
        model.eval()
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            if is_conversational({"prompt": chunk[0]}):
                batch = tokenizer.apply_chat_template(
                    chunk,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    return_tensors="pt",
                    padding=True,
                    tokenizer_kwargs={"padding_side": "left"},
                    chat_template=trainer.chat_template,
                    **(trainer.chat_template_kwargs or {}),
                )
            else:
                batch = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
            batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            # in the trainer's compute precision, before training as after: accelerate wraps the model's forward in
            # autocast only when train() prepares it, so without this a measurement before training would be float32
            # and one after bf16 autocast, a difference that is no learning
            with trainer.accelerator.autocast():
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    synced_gpus=trainer._dist.is_zero3,
                )
            completions += tokenizer.batch_decode(out[:, batch["input_ids"].size(1) :], skip_special_tokens=True)
        model.train(was_training)
    return completions


def greedy_scores(trainer, dataset, reward_funcs: dict[str, Callable]) -> dict[str, float]:
    """The mean of each reward function (by name) over one greedy completion per row of ``dataset``, generated once
    (the other columns are passed to every function as keyword arguments, as GRPOTrainer does)."""
    prompts = list(dataset["prompt"])
    completions = greedy_completions(trainer, prompts, trainer.max_completion_length)
    columns = {k: list(dataset[k]) for k in dataset.column_names if k != "prompt"}
    if is_conversational({"prompt": prompts[0]}):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    scored = {}
    for name, reward_func in reward_funcs.items():
        scores = reward_func(prompts=prompts, completions=completions, **columns)
        scored[name] = sum(float(s) for s in scores) / len(scores)
    return scored


def greedy_accuracy(trainer, dataset, reward_func: Callable) -> float:
    """Mean of ``reward_func`` over one greedy completion per row of ``dataset``."""
    return greedy_scores(trainer, dataset, {"accuracy": reward_func})["accuracy"]


class GreedyAccuracyCallback(TrainerCallback):
    """On every evaluation, log ``eval_greedy_accuracy`` (and the seconds it took, ``eval_greedy_seconds``): greedy
    accuracy of the current weights on ``dataset`` under ``reward_func``. ``history`` keeps ``(step, accuracy)``.
    ``also`` (name -> reward function) scores the same greedy completions under more functions, logged as
    ``eval_greedy_<name>``; ``scores`` keeps ``(step, {"accuracy": ..., name: ...})``."""

    def __init__(self, trainer, dataset, reward_func: Callable, also: dict[str, Callable] | None = None) -> None:
        self.trainer, self.dataset, self.reward_func = trainer, dataset, reward_func
        self.also = dict(also or {})
        taken = {"accuracy", "seconds"} & set(self.also)  # reward_func's score, and the logged eval_greedy_seconds
        if taken:
            raise ValueError(
                f"GreedyAccuracyCallback: `also` may not use the names {sorted(taken)}: they are logged "
                "already (eval_greedy_accuracy, eval_greedy_seconds); rename them"
            )
        self.history: list[tuple[int, float]] = []
        self.scores: list[tuple[int, dict[str, float]]] = []

    def measure_all(self) -> dict[str, float]:
        return greedy_scores(self.trainer, self.dataset, {"accuracy": self.reward_func, **self.also})

    def measure(self) -> float:
        return self.measure_all()["accuracy"]

    def on_evaluate(self, args, state, control, **kwargs):
        start = time.perf_counter()
        scores = self.measure_all()
        self.history.append((state.global_step, scores["accuracy"]))
        self.scores.append((state.global_step, scores))
        self.trainer.log(
            {
                **{f"eval_greedy_{name}": value for name, value in scores.items()},
                "eval_greedy_seconds": time.perf_counter() - start,
            }
        )
