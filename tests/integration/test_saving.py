"""What GRPOTrainer does around training carries over unchanged: checkpoints every ``save_steps``, ``save_model``
giving the trained weights, and ``log_completions`` recording the prompts, completions and rewards that trained."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, letter_reward, text_dataset


def test_checkpoints_and_save_model_hold_the_trained_weights(tmp_path, tiny_model_dir):
    args = async_args(tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=1)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    trainer.train()
    for step in (1, 2):
        state = json.loads((tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["global_step"] == step and "PromptProgress" in state["stateful_callbacks"]
        assert any("async/staleness_mean" in entry for entry in state["log_history"])
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    trained = trainer.model.state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k].cpu()) for k in saved)
    assert any(not torch.equal(saved[k], start[k]) for k in saved)  # it trained: the saved weights moved


def test_log_completions_records_what_trained(tmp_path, tiny_model_dir):
    rows = text_dataset()
    args = async_args(tmp_path, max_steps=2, log_completions=True, num_completions_to_print=2)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=rows)
    trainer.train()
    logs = trainer._logs
    batch = args.per_device_train_batch_size  # GRPOTrainer keeps the last generation batch's
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["rewards"]["letter_reward"]) == batch
    assert set(logs["prompt"]) <= set(rows["prompt"])
    # each logged reward is the reward function's value for the logged prompt's row and completion
    letter = dict(zip(rows["prompt"], rows["letter"], strict=True))
    expected = [
        letter_reward([p], [c], [letter[p]])[0] for p, c in zip(logs["prompt"], logs["completion"], strict=True)
    ]
    assert list(logs["rewards"]["letter_reward"]) == pytest.approx(expected)
